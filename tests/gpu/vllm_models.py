"""Tiny random-weight model directories of the shapes kvwatch must be right on, for a real vLLM
(``--load-format dummy``: no weights are read). Each takes the tokenizer files of the tiny Llama
that ``make_tiny_model.py`` wrote and a config of its own:

* ``hybrid``  — Gemma-3-style text model: five sliding-window layers (window 256) to one
  full-attention layer. vLLM 0.26 makes one full-attention KV cache group and five
  sliding-window groups, and announces every block range once per group.
* ``sliding`` — Mistral-style: every layer sliding-window (window 256): one group of kind
  sliding_window.

    python3 tests/gpu/vllm_models.py /tmp/tiny /tmp/models     (writes /tmp/models/{hybrid,sliding,...})
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

WINDOW = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def hybrid() -> dict[str, Any]:
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": len(layers),
        "layer_types": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 128,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def sliding() -> dict[str, Any]:
    layers = 8
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": layers,
        "layer_types": ["sliding_attention"] * layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "sliding_window": WINDOW,
        "max_position_embeddings": 4096,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def sliding_gemma() -> dict[str, Any]:
    """The stand-in should the sliding-only Mistral config not load: Gemma 3 with every layer sliding."""
    c = hybrid()
    c["layer_types"] = ["sliding_attention"] * len(c["layer_types"])
    return c


SHAPES = {"hybrid": hybrid, "sliding": sliding, "sliding_gemma": sliding_gemma}


def write(tiny: Path, out: Path) -> list[Path]:
    made = []
    for name, config in SHAPES.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f in TOKENIZER_FILES:
            if (tiny / f).exists():
                shutil.copy(tiny / f, d / f)
        (d / "config.json").write_text(json.dumps(config(), indent=1))
        made.append(d)
    return made


if __name__ == "__main__":
    for d in write(Path(sys.argv[1]), Path(sys.argv[2])):
        print("wrote", d)
