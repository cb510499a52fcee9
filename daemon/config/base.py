"""What every section of the configuration shares: unknown keys refused, values frozen."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
SECTION = ConfigDict(extra="forbid", frozen=True)  # each module's section base takes this
