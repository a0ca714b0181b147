"""Site pins in configuration: ``op@module.glob=backend`` applies to kernelized layers only."""

from __future__ import annotations

import pytest

from kernreg import ConfigError
from kernreg.config import load_config


def test_site_pin_is_parsed_and_kept_out_of_the_op_pin() -> None:
    config = load_config({"KERNREG_PIN": "layernorm.rmsnorm@model.norm=torch,layernorm.*=aten"})
    site, plain = config.pins
    assert (site.pattern, site.site, site.backend) == ("layernorm.rmsnorm", "model.norm", "torch")
    assert str(site) == "layernorm.rmsnorm@model.norm=torch"
    assert plain.site is None
    assert config.pin_for("layernorm.rmsnorm") == plain  # the op's own decision: not the site pin


def test_site_pin_alone_pins_no_op() -> None:
    config = load_config({"KERNREG_PIN": "layernorm.rmsnorm@model.layers.*.mlp=torch/v2"})
    assert config.pin_for("layernorm.rmsnorm") is None
    assert config.pins[0].variant == "v2"


@pytest.mark.parametrize(
    "value",
    ["layernorm.rmsnorm@=torch", "Bad Op@model.norm=torch", "layernorm.rmsnorm@model.norm="],
)
def test_bad_site_pins_are_rejected_when_read(value: str) -> None:
    with pytest.raises(ConfigError, match="KERNREG_PIN"):
        load_config({"KERNREG_PIN": value})


def test_the_same_site_pinned_twice_differently_is_an_error() -> None:
    with pytest.raises(ConfigError, match="pinned twice"):
        load_config({"KERNREG_PIN": "layernorm.rmsnorm@a=torch,layernorm.rmsnorm@a=aten"})
    both = load_config({"KERNREG_PIN": "layernorm.rmsnorm@a=torch,layernorm.rmsnorm@b=aten"})
    assert len(both.pins) == 2
