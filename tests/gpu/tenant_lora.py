"""Dummy PEFT LoRA adapters for the tiny Llama of ``make_tiny_model.py``, for vLLM's
``--enable-lora --lora-modules NAME=DIR`` (the tenant validation's adapter traffic).

Each adapter directory holds ``adapter_config.json`` (LoRA, rank 8, on q_proj and v_proj) and
``adapter_model.safetensors``: per layer ``base_model.model.model.layers.N.self_attn.{q,v}_proj.
lora_{A,B}.weight``, A small random numbers, B zeros (the adapter changes nothing; vLLM still
serves it as an adapter and hashes its name into every block). The safetensors file is written by
hand (float32, numpy only): vLLM converts the tensors to the model's dtype when it loads them.

    python3 tests/gpu/tenant_lora.py /tmp/tiny /tmp/loras lora-x lora-y
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

RANK = 8
TARGETS = ("q_proj", "v_proj")


def shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    return {"q_proj": (heads * head_dim, hidden), "v_proj": (kv * head_dim, hidden)}


def tensors(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target, (n_out, n_in) in shapes(config).items():
            stem = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            out[f"{stem}.lora_A.weight"] = (rng.standard_normal((RANK, n_in)) * 0.01).astype(np.float32)
            out[f"{stem}.lora_B.weight"] = np.zeros((n_out, RANK), dtype=np.float32)
    return out


def write_safetensors(path: Path, named: dict[str, np.ndarray]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in named.items():
        n = t.nbytes
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in named.values():
            f.write(np.ascontiguousarray(t).tobytes())


def write(model: Path, out: Path, name: str, seed: int) -> Path:
    config = json.loads((model / "config.json").read_text())
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (d / "adapter_config.json").write_text(json.dumps(adapter, indent=1))
    write_safetensors(d / "adapter_model.safetensors", tensors(config, seed))
    return d


if __name__ == "__main__":
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    for i, name in enumerate(sys.argv[3:]):
        print("wrote", write(model, out, name, seed=i + 1))
