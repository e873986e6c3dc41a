"""What every config section shares: the error a bad configuration raises, and the base model
whose settings make a misspelt key an error and a loaded tree immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names each bad field."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors (`extra="forbid"`), a loaded tree is frozen,
    and defaults are validated like given values."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
