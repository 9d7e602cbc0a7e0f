"""The YAML schema: ``FSDPConfig`` and its parts, loading (the one place YAML is read) and pydantic's errors
as ``Problem``s.

    mesh: {replicate: 1, shard: -1}
    reshard_after_forward: auto          # true | false | int | auto (root false, others true)
    mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}
    offload: {device: none}              # none | cpu
    wrap:                                # ordered; the first rule a module matches wins
      - match: {class: Block}            # each matched module becomes its own group
      - match: {path: [norm, head]}
        group: true                      # all matches of this rule form one group
        mixed_precision: {param_dtype: fp32}
    ignore:
      - {path: "*.rotary.*"}             # parameters left unsharded and unreduced
    schedule:                            # the root's schedule settings; auto = the device's default
      forward_prefetch_depth: auto       # int >= 0 | auto (1 on CPU, 0 on CUDA)
      late_backward_prefetch: auto       # true | false | auto (true on CPU, false on CUDA)
      overlap_reduce_scatter: auto       # true | false | auto (false on CPU, true on CUDA)

YAML is read in exactly one function (``FSDPConfig.from_yaml``); everything after works on validated
objects. Errors are collected, not raised one by one: ``ConfigError.problems`` lists every problem
with its location, message and, for unknown keys, the closest valid key (``problems_from``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .._units import parse_size
from ..mesh import resolve_mesh_degrees
from ..policies import (
    CommPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingPolicy,
    from_torch_policy,
)
from .errors import ConfigError, Problem
from .precision import PrecisionOverride
from .validation import problems_from_errors

_STRICT = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
ReshardAfterForward = bool | int | Literal["auto"]


class MeshConfig(BaseModel):
    """Device mesh degrees. ``replicate > 1`` means HSDP: shard within groups, replicate across them."""

    model_config = _STRICT

    replicate: int = Field(
        1, description="replicas (outer mesh axis); 1 = plain FSDP; -1 = world_size / shard (set shard)"
    )
    shard: int = Field(-1, description="ranks each parameter is sharded over; -1 = world_size / replicate")

    @field_validator("replicate", "shard")
    @classmethod
    def _positive_or_auto(cls, value: int, info: ValidationInfo) -> int:
        if value != -1 and value < 1:
            name = info.field_name
            raise ValueError(f"{name} must be a positive rank count or -1 (the remaining ranks), got {value}")
        return value

    @model_validator(mode="after")
    def _one_auto_degree(self) -> MeshConfig:
        if self.replicate == -1 and self.shard == -1:
            raise ValueError(
                "replicate: -1 takes the ranks that shard leaves, so shard must be a number (e.g. shard: 8 with "
                "replicate: -1 is HSDP over groups of 8 ranks, as many groups as the world size allows)"
            )
        return self

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) for ``world_size`` ranks; raises with the numbers when they do not fit."""
        return resolve_mesh_degrees(self.replicate, self.shard, world_size)


class OffloadConfig(BaseModel):
    """Where sharded parameters and gradients live between uses."""

    model_config = _STRICT

    device: Literal["none", "cpu"] = Field(
        "none",
        description="none: on the device (with budget: the groups the planner does not offload); cpu: on the host",
    )
    pin_memory: bool = Field(True, description="pin host memory (with device: cpu) for async copies; needs CUDA")
    optimizer_only: bool = Field(
        False,
        description="with device: cpu, ZeRO-Offload's shape: shards stay on the device, fp32 masters, "
        "gradients and optimizer state live and step on the host",
    )
    optimizer: Literal["cpu", "nvme"] = Field(
        "cpu",
        description="with device: cpu, where the optimizer state lives between steps: cpu (host memory) or nvme "
        "(one file per rank under nvme_path, streamed group by group at each step)",
    )
    nvme_path: str | None = Field(None, description="with optimizer: nvme, the directory that holds the state files")
    budget: str | None = Field(
        None,
        description="top level only, with device: none: device memory per rank (e.g. 20GiB); the planner "
        "offloads the largest groups first (the kind optimizer_only says) until its estimate fits "
        "(fsdp2lite estimate --config ... --write-config resolves it)",
    )

    @field_validator("budget")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)  # ValueError naming the text and the forms a size takes
        return value

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else parse_size(self.budget)

    def to_policy(self) -> OffloadPolicy:
        if self.device != "cpu":
            return OffloadPolicy()
        return CPUOffloadPolicy(
            pin_memory=self.pin_memory,
            optimizer_only=self.optimizer_only,
            optimizer=self.optimizer,
            nvme_path=self.nvme_path,
        )

    @model_validator(mode="after")
    def _optimizer_only_needs_cpu(self) -> OffloadConfig:
        if self.budget is not None and self.device != "none":
            raise ValueError(
                f"budget: {self.budget} chooses which groups go to the host, but device: {self.device} sends every "
                "group there: leave device at none with a budget (optimizer_only: true picks ZeRO-Offload's kind)"
            )
        if self.budget is not None:
            return self
        if self.optimizer_only and self.device != "cpu":
            raise ValueError(
                f"optimizer_only: true moves the optimizer to the host, but device is {self.device!r}: "
                "set device: cpu with it (or drop optimizer_only)"
            )
        if self.optimizer == "nvme" and self.device != "cpu":
            raise ValueError(
                f"optimizer: nvme streams the optimizer state through the host, but device is {self.device!r}: "
                "set device: cpu with it (optimizer_only: true keeps the shards on the device)"
            )
        return self

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadConfig:
        if self.optimizer == "nvme" and not (self.nvme_path or "").strip():
            raise ValueError("optimizer: nvme keeps the optimizer state in files: give nvme_path (a directory)")
        if self.optimizer == "cpu" and self.nvme_path is not None:
            raise ValueError(
                f"nvme_path: {self.nvme_path} is only read with optimizer: nvme: set it, or drop nvme_path"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _from_policy(cls, value: Any) -> Any:
        """An offload policy object (fsdp2lite's or torch's) where the config's offload section goes."""
        policy = from_torch_policy(value)
        if isinstance(policy, CPUOffloadPolicy):
            return {"device": "cpu", **policy.model_dump()}  # every CPUOffloadPolicy field is one of ours
        if isinstance(policy, OffloadPolicy):
            return {"device": "none"}
        return value


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML requires unique keys; PyYAML
    would keep the last value silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(
                    Problem(
                        f"line {line}",
                        f"key {key!r} is given twice in one mapping (first on line {seen[key]})",
                        "keep one of them: YAML keys must be unique, and the last would silently win",
                    )
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class Match(BaseModel):
    """Which modules (or, under ``ignore``, which parameters) a rule selects; given keys must all match."""

    model_config = _STRICT

    class_: str | list[str] | None = Field(
        None, alias="class", description="module class name(s), e.g. Block or [Block, MLP]"
    )
    path: str | list[str] | None = Field(
        None, description="glob(s) over module paths (parameter names under ignore), e.g. 'layers.*'"
    )

    @model_validator(mode="after")
    def _not_empty(self) -> Match:
        if self.class_ is None and self.path is None:
            raise ValueError("a match needs 'class' and/or 'path'")
        return self

    def matches(self, path: str, class_name: str) -> bool:
        if self.class_ is not None and class_name not in as_list(self.class_):
            return False
        return self.path is None or any(fnmatch.fnmatchcase(path, glob) for glob in as_list(self.path))

    def matcher(self) -> Callable[[str, str], bool]:
        """``matches`` as one function made once: a set of class names and one regular expression of the globs
        (a plan tests every module of a model against every rule)."""
        classes = None if self.class_ is None else frozenset(as_list(self.class_))
        globs = None if self.path is None else as_list(self.path)
        regex = None if globs is None else re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))

        def test(path: str, class_name: str) -> bool:
            return (classes is None or class_name in classes) and (regex is None or regex.match(path) is not None)

        return test


class ScheduleConfig(BaseModel):
    """The root's schedule settings (docs/design.md, "Devices"); ``auto`` keeps the device's default."""

    model_config = _STRICT

    forward_prefetch_depth: int | Literal["auto"] = Field(
        "auto", description="groups all-gathered ahead in forward; auto: 1 on CPU, 0 on CUDA"
    )
    late_backward_prefetch: bool | Literal["auto"] = Field(
        "auto",
        description="in backward, all-gather the next group after this group's reduce-scatter (true) or at "
        "its pre-backward (false); auto: true on CPU, false on CUDA",
    )
    overlap_reduce_scatter: bool | Literal["auto"] = Field(
        "auto",
        description="wait each reduce-scatter one group later, overlapping the next group's backward (true) "
        "or right after issuing it (false); auto: false on CPU, true on CUDA",
    )

    @field_validator("forward_prefetch_depth", mode="before")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise ValueError(f"forward_prefetch_depth is a group count >= 0 or auto, got {value!r}")
        return value

    def apply_to(self, root: Any) -> None:
        """Set every non-auto value on ``root`` (an FSDPModule that will be the root) through its
        ``set_<key>`` method, which checks it."""
        for key, value in self.model_dump().items():
            if value != "auto":
                getattr(root, f"set_{key}")(value)


class WrapRule(BaseModel):
    """One wrap rule: the modules it matches become groups, with optional policy overrides."""

    model_config = _STRICT

    match: Match = Field(description="which modules this rule takes")
    group: bool | Literal["tied"] = Field(
        False,
        description="true: all matches form ONE group; false: one group per match; tied: one group per match, "
        "except that matches sharing a parameter (a tied embedding and head) form one group together",
    )
    reshard_after_forward: ReshardAfterForward | None = Field(None, description="overrides the top-level value")
    mixed_precision: MixedPrecisionPolicy | None = Field(
        None, description="overrides the top-level fields it sets; the others are inherited"
    )
    offload: OffloadConfig | None = Field(None, description="overrides the top-level offload")
    communication: CommPolicy | None = Field(
        None, description="overrides the top-level fields it sets; the others are inherited"
    )
    sharding: ShardingPolicy | None = Field(
        None, description="overrides the top-level sharding (e.g. experts kept resident: shard: optimizer)"
    )
    reduce_scatter_unused_params: bool | None = Field(None, description="overrides the top-level value")
    unshard_in_backward: bool = Field(
        True, description="false: never all-gather these groups in backward (their backward needs no values)"
    )
    activation_checkpointing: bool = Field(
        False, description="true: recompute these modules' forward in backward instead of keeping activations"
    )


class ShardPlacementRule(BaseModel):
    """Parameters (by name glob) sharded on another dim than 0: ``shard_placement_fn`` as YAML."""

    model_config = _STRICT

    path: str | list[str] = Field(description="glob(s) over parameter names, e.g. '*.experts.*.weight'")
    dim: int = Field(description="the dim to shard on (torch.chunk along it); negative counts from the end")


class FSDPConfig(BaseModel):
    """A whole sharding setup: mesh, top-level policies, wrap rules, ignored parameters and the schedule."""

    model_config = _STRICT

    mesh: MeshConfig = Field(default_factory=MeshConfig, description="mesh degrees (see MeshConfig)")
    reshard_after_forward: ReshardAfterForward = Field(
        "auto",
        description="true | false | int (reshard to groups of that many ranks) | auto (root false, others true)",
    )
    mixed_precision: MixedPrecisionPolicy = Field(
        default_factory=MixedPrecisionPolicy, description="top-level mixed precision"
    )
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="top-level offload")
    communication: CommPolicy = Field(
        default_factory=CommPolicy,
        description="what the collectives send: quantized all-gather, all-to-all reduce-scatter (see CommPolicy)",
    )
    sharding: ShardingPolicy = Field(
        default_factory=ShardingPolicy,
        description="what each mesh axis shards: shard: params (ZeRO-3, default) | optimizer (ZeRO-1/2); "
        "replicate: none (HSDP, default) | optimizer (HFSDP: masters and optimizer state sharded across replicas)",
    )
    zero_stage: Literal[1, 2, 3] | None = Field(
        None, description="DeepSpeed's shorthand for sharding.shard: 3 = params, 1 and 2 = optimizer"
    )
    wrap: list[WrapRule] = Field(default_factory=list, description="ordered wrap rules; first match wins")
    ignore: list[Match] = Field(default_factory=list, description="parameters left unsharded and unreduced")
    shard_placement: list[ShardPlacementRule] = Field(
        default_factory=list, description="parameters sharded on another dim than 0; first match wins"
    )
    precision_overrides: list[PrecisionOverride] = Field(
        default_factory=list, description="parameters with dtypes of their own inside their group; first match wins"
    )
    reduce_scatter_unused_params: bool = Field(
        False, description="reduce zeros for parameters that got no gradient (ranks using different experts)"
    )
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig, description="the root's schedule settings (see ScheduleConfig)"
    )

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, value: Any) -> Any:
        """YAML's true would pass as stage 1 (True == 1): refused as the choice it is not."""
        if isinstance(value, bool):
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": "1, 2 or 3"})
        return value

    @model_validator(mode="after")
    def _zero_stage(self) -> FSDPConfig:
        """``zero_stage`` sets the shard axis (``sharding.shard``) and leaves ``sharding.replicate`` as given."""
        if self.zero_stage is None:
            return self
        implied = ShardingPolicy.zero_stage(self.zero_stage).shard
        if "shard" in self.sharding.model_fields_set and self.sharding.shard != implied:
            raise ValueError(
                f"zero_stage: {self.zero_stage} means sharding.shard: {implied}, but sharding says "
                f"shard: {self.sharding.shard}; give one of them"
            )
        object.__setattr__(self, "sharding", self.sharding.model_copy(update={"shard": implied}))
        return self

    @model_validator(mode="after")
    def _budget_at_the_top(self) -> FSDPConfig:
        """A budget is one number for the whole model: refused in a wrap rule's offload."""
        for index, rule in enumerate(self.wrap):
            if rule.offload is not None and rule.offload.budget is not None:
                raise ValueError(
                    f"wrap[{index}].offload.budget: {rule.offload.budget}: a budget is for the whole model; give it "
                    "in the top-level offload section"
                )
        return self

    @model_validator(mode="after")
    def _replicate_axis(self) -> FSDPConfig:
        """``replicate: optimizer`` (HFSDP) needs replicas: refused on a mesh with ``replicate: 1``."""
        if self.mesh.replicate != 1:
            return self
        where = ["sharding"] if self.sharding.replica_sharded else []
        where += [
            f"wrap[{index}].sharding"
            for index, rule in enumerate(self.wrap)
            if rule.sharding is not None and rule.sharding.replica_sharded
        ]
        if where:
            raise ValueError(
                f"{where[0]}.replicate: optimizer (HFSDP) shards masters and optimizer state across the replicas "
                "of a 2-D mesh, but mesh.replicate is 1 (a 1-D mesh): set mesh.replicate to 2 or more (or -1 with "
                "shard given), or use replicate: none"
            )
        return self

    @field_validator("reshard_after_forward")
    @classmethod
    def _positive_int(cls, value: ReshardAfterForward) -> ReshardAfterForward:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"an int reshard_after_forward is a rank count >= 1, got {value}")
        return value

    @classmethod
    def from_yaml(cls, path: str | Path) -> FSDPConfig:
        """Load and validate a YAML file; raises ``ConfigError`` listing every problem found."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(path, [Problem("", f"cannot read the file: {exc.strerror or exc}", "")]) from None
        except UnicodeDecodeError:
            raise ConfigError(path, [Problem("", "not a text file (not UTF-8): is this a YAML config?", "")]) from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
        except _DuplicateKey as exc:
            raise ConfigError(path, [exc.problem]) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(path, [Problem(where, f"not valid YAML: {problem}", "")]) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            found = type(data).__name__
            raise ConfigError(path, [Problem("", f"the top level must be a mapping of keys, got a {found}", "")])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(path, problems_from(exc)) from None

    def to_yaml(self) -> str:
        """The config as YAML (dtypes by their short names); ``from_yaml`` reads it back equal."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# ---- errors ---------------------------------------------------------------------------------------


def problems_from(exc: ValidationError) -> list[Problem]:
    """pydantic's errors in validating an ``FSDPConfig`` as Problems, each naming the value given and what
    would be valid (``validation.problems_from_errors``)."""
    return problems_from_errors(exc, FSDPConfig)


def as_list(value: str | list[str]) -> list[str]:
    """A rule's one-or-many field (a class name or glob, or a list of them) as a list."""
    return [value] if isinstance(value, str) else value
