"""The policy models: immutable, strict, hashable, documented, with one dtype parser."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import fsdp2lite as fl
from fsdp2lite.policies import DTYPE_NAMES, parse_dtype


@pytest.mark.parametrize(("name", "dtype"), sorted(DTYPE_NAMES.items()))
def test_every_dtype_name(name: str, dtype: torch.dtype) -> None:
    assert fl.MixedPrecisionPolicy(param_dtype=name).param_dtype is dtype
    assert fl.MixedPrecisionPolicy(param_dtype=name.upper()).param_dtype is dtype
    assert fl.MixedPrecisionPolicy(param_dtype=dtype).param_dtype is dtype


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_bad_dtype_names_the_field_and_the_valid_names(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        fl.MixedPrecisionPolicy(**{field: "int8"})
    [error] = info.value.errors()
    assert error["loc"] == (field,)
    assert "'int8' is not a dtype; valid names: bf16, bfloat16, fp16" in error["msg"]
    with pytest.raises(ValidationError, match=r"dtype torch.int32 is not supported"):
        fl.MixedPrecisionPolicy(**{field: torch.int32})


def test_frozen_strict_hashable() -> None:
    policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    with pytest.raises(ValidationError, match="frozen"):
        policy.param_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(ValidationError, match="param_dtpye"):
        fl.MixedPrecisionPolicy(param_dtpye="bf16")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="Extra inputs"):
        fl.CPUOffloadPolicy(pin=True)  # type: ignore[call-arg]
    same = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype="float32")
    assert policy == same and hash(policy) == hash(same)
    assert len({policy, same, fl.MixedPrecisionPolicy()}) == 2
    assert hash(fl.CPUOffloadPolicy()) == hash(fl.CPUOffloadPolicy(pin_memory=True))
    assert fl.CPUOffloadPolicy() != fl.OffloadPolicy()


def test_serialises_dtypes_by_name() -> None:
    policy = fl.MixedPrecisionPolicy(param_dtype="bfloat16", output_dtype=torch.float32)
    dumped = policy.model_dump(mode="json")
    assert dumped == {"param_dtype": "bf16", "reduce_dtype": None, "output_dtype": "fp32", "cast_forward_inputs": True}
    assert fl.MixedPrecisionPolicy.model_validate(dumped) == policy


@pytest.mark.parametrize("model", [fl.MixedPrecisionPolicy, fl.CPUOffloadPolicy])
def test_every_field_is_described_in_the_json_schema(model: type) -> None:
    properties = model.model_json_schema()["properties"]
    assert properties, model
    for name, spec in properties.items():
        assert spec.get("description"), f"{model.__name__}.{name} has no description"


def test_parse_dtype_none_means_no_cast() -> None:
    assert parse_dtype(None) is None
