"""``fsdp2lite estimate --budget``: the settings that fit, and the fastest of them.

Each setting is estimated with the analytic method (the whole search answers in seconds, a 70B model
included) and timed on the named link and GPU (``estimate.timing``). A setting fits when its *reserved*
device peak (what the caching allocator holds: an OOM comes from that) with ``room`` beside it (512 MiB, or a
twentieth of a smaller budget, for NCCL's buffers and cuBLAS workspaces) is within the budget less the CUDA
context (``estimate.cuda_context``) and its
host memory per machine (CPU offload's shards, gradients and optimizer state at the sizes pinning takes,
times the ranks on one machine: [Note: host bytes]) within ``--host-ram``. The choice is the fitting setting
with the most tokens per second; ties go to the least offload, then the smaller peak.

Without ``--finetune`` the search covers what to train: full, lora and qlora, each with and without
activation checkpointing and offload (none, ``optimizer_only``: ZeRO-Offload, or full) (bf16 compute). With
``--finetune`` given, it covers how to shard that job: mixed precision (full only), reshard after forward,
forward prefetch depth, activation checkpointing and the three offloads.

Offload granularity, in either: each offload (``optimizer_only`` or full) is tried for every group, and where
it helps two more ways: per group (``offload_groups``: the fewest largest groups whose offload fits the device,
``offload_budget``'s resolution, tried where the setting without offload does not fit and with every group
offloaded does), and with its optimizer state on NVMe (``optimizer_state: nvme``, tried where the host-memory
one fits the device but not ``--host-ram``: the same device memory, less host memory, a slower step). The
written config's ``nvme_path`` is ``--nvme-path`` (a placeholder by default: point it at a local NVMe drive).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from ..config import FSDPConfig
from ..estimate import element_size
from ..estimate.analytic import analytic_estimate
from ..estimate.common import cached_plan, default_seq
from ..estimate.finetune import Finetune, planned_factory
from ..estimate.offload_budget import largest_groups, offload_largest, resolve_offload_budget
from ..estimate.plan_bytes import nf4_paths
from ..estimate.timing import NVME_GB_PER_S, Gpu, Link, plan_step_time
from ._args import UsageError

ROOM = 2**29  # left free on a CUDA target for NCCL's buffers and cuBLAS workspaces, which no estimate counts (room)
OFFLOADS = (False, "optimizer", True)  # none, ZeRO-Offload (optimizer_only: masters and state on the host), full
DEFAULT_NVME_PATH = "/local/nvme"  # a placeholder for the written config's nvme_path (--nvme-path)
SEARCH: dict[str, tuple[Any, ...]] = {
    "mixed_precision": ("fp32", "bf16"),
    "reshard_after_forward": (False, True),
    "forward_prefetch_depth": (1, 0),
    "activation_checkpointing": (False, True),
    "offload": OFFLOADS,
}
FINETUNE_SEARCH: dict[str, tuple[Any, ...]] = {
    "finetune": ("full", "lora", "qlora"),
    "activation_checkpointing": (False, True),
    "offload": OFFLOADS,
}
FIXED = {"mixed_precision": "bf16", "reshard_after_forward": True, "forward_prefetch_depth": 1}
SHOWN = ("finetune", *SEARCH, "offload_groups", "optimizer_state")


@dataclass
class SearchJob:
    """What every setting of one search shares."""

    factory: Any
    spec: str
    common: dict[str, Any]  # estimate_memory's keyword arguments (analytic is used whatever the method)
    finetune: Finetune  # rank and targets; its kind is searched when ``search_finetune``
    search_finetune: bool
    link: str | Link
    gpu: str | Gpu
    ranks_per_node: int
    host_ram: int
    nvme_path: str = DEFAULT_NVME_PATH  # the written config's, for optimizer state on NVMe
    excluded: tuple[str, ...] = ()  # fine-tuning kinds the feasibility rule refused ([Note: one feasibility rule])


def search_space(base: FSDPConfig, world_size: int, job: SearchJob) -> dict[str, tuple[Any, ...]]:
    """``FINETUNE_SEARCH`` when the fine-tuning kind is searched; else ``SEARCH`` for that kind (bf16
    only for lora/qlora), with ``reshard_after_forward: k`` added for the divisor k of the shard degree
    closest to its square root from below (when there is one between 1 and the degree)."""
    if job.search_finetune:
        kinds = tuple(kind for kind in FINETUNE_SEARCH["finetune"] if kind not in job.excluded)
        return {**FINETUNE_SEARCH, "finetune": kinds}
    _, shard = base.mesh.resolve(world_size)
    divisors = [k for k in range(2, shard) if shard % k == 0 and k * k <= shard]
    space = {"finetune": (job.finetune.kind,), **SEARCH}
    if job.finetune.adapters:
        space["mixed_precision"] = ("bf16",)
    if divisors:
        space["reshard_after_forward"] = (*SEARCH["reshard_after_forward"], divisors[-1])
    return space


def search_budget(
    job: SearchJob, base: FSDPConfig, budget: int, caches: dict[bool, dict[Any, Any]]
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Every setting of ``search_space`` on top of ``base``, estimated and timed; (the choice, every row).
    ``caches``: per "has adapters", the meta model and its activation traces, shared by the settings."""
    space = search_space(base, job.common["world_size"], job)
    others = {key: values for key, values in space.items() if key != "offload"}
    tried = []
    for values in itertools.product(*others.values()):
        settings = {**FIXED, **dict(zip(others, values))}
        tried += _offload_rows(job, base, settings, budget, caches)
    fitting = [row for row in tried if row["fits"]]
    choice = min(fitting, key=search_order) if fitting else None
    return choice, tried


def _offload_rows(
    job: SearchJob, base: FSDPConfig, settings: dict[str, Any], budget: int, caches: dict[bool, dict[Any, Any]]
) -> list[dict[str, Any]]:
    """One setting's rows, one per offload (module docstring): none, optimizer_only and full for every
    group; per group where no offload is over the device budget and every group offloaded is not; with
    the optimizer state on NVMe where the host-memory row fits the device but not ``--host-ram``."""
    rows = []
    for offload in OFFLOADS:
        if settings["finetune"] == "qlora" and offload == "optimizer":
            continue  # NF4 weights gather through hooks, which optimizer_only refuses
        kind = {**settings, "offload": offload, "offload_groups": "all" if offload else None}
        kind.update(optimizer_state="host", nvme_path=None)
        rows.append(evaluate(job, config_for_setting(base, kind), kind, budget, caches))
    if not rows[0]["device_fits"] and job.common["device"] == "cuda":  # rows[0]: no offload; a host to offload to
        rows += [_per_group_row(job, base, row, budget, caches) for row in rows[1:] if row["device_fits"]]
    for row in [row for row in rows if row["offload"] and row["device_fits"] and not row["host_fits"]]:
        kind = {key: row[key] for key in (*settings, "offload", "offload_groups")}
        kind.update(optimizer_state="nvme", nvme_path=job.nvme_path)
        model = caches[kind["finetune"] != "full"]["model"]
        rows.append(evaluate(job, config_for_setting(base, kind, model), kind, budget, caches))
    return rows


def _per_group_row(
    job: SearchJob, base: FSDPConfig, every: dict[str, Any], budget: int, caches: dict[bool, dict[Any, Any]]
) -> dict[str, Any]:
    """``every``'s offload for the fewest largest groups whose reserved peak fits ``budget``
    ([Note: offload budget]); ``offload_groups`` is how many."""
    kind = {key: every[key] for key in every if key in (*SHOWN, *FIXED, "nvme_path")}
    finetune = Finetune(kind["finetune"], job.finetune.rank, job.finetune.targets)
    keys = ("world_size", "batch", "seq", "optimizer", "device", "inputs")
    placement = resolve_offload_budget(
        planned_factory(job.factory, finetune), _settings_config(base, {**kind, "offload_groups": 0}, str(budget)),
        **{key: job.common[key] for key in keys}, cache=caches.setdefault(finetune.adapters, {}), finetune=finetune,
        fits=lambda found: (found.reserved_bytes or found.peak_bytes) + room(job.common["device"], budget) <= budget,
    )  # fmt: skip
    kind["offload_groups"] = len(placement.offloaded)
    return evaluate(job, placement.config, kind, budget, caches)


def room(device: str, budget: int) -> int:
    """What a setting leaves free of ``budget`` on its target: on CUDA ``ROOM``, or a twentieth of a smaller
    budget (what no estimate counts needs a place); nothing on a CPU target."""
    return min(ROOM, budget // 20) if device == "cuda" else 0


def evaluate(
    job: SearchJob, config: FSDPConfig, settings: dict[str, Any], budget: int, caches: dict[bool, dict[Any, Any]]
) -> dict[str, Any]:
    """One setting's row: its estimate, timing and whether it fits (the device budget, ``--host-ram``)."""
    finetune = Finetune(settings["finetune"], job.finetune.rank, job.finetune.targets)
    cache = caches.setdefault(finetune.adapters, {})
    factory = planned_factory(job.factory, finetune)
    common = job.common
    try:
        estimate = analytic_estimate(
            factory, config, common["world_size"], common["rank"], common["inputs"], common["batch"],
            common["seq"], common["optimizer"], common["device"], cache=cache, finetune=finetune,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot estimate {job.spec}: {exc}", prog="fsdp2lite estimate") from None
    model = cache["model"]
    speed = setting_time(model, config, job, finetune, cache)
    per_node = job.ranks_per_node
    reserved = estimate.reserved_bytes or estimate.peak_bytes
    free = room(common["device"], budget)
    device_fits, host_fits = reserved + free <= budget, estimate.host_bytes * per_node <= job.host_ram
    return {
        **settings,
        "peak_bytes": estimate.peak_bytes,
        "reserved_bytes": reserved,
        "reserved_expandable_bytes": estimate.reserved_expandable_bytes or reserved,
        "host_bytes": estimate.host_bytes,
        "host_bytes_per_machine": estimate.host_bytes * per_node,
        "host_exact_bytes": estimate.host_exact_bytes,
        "nvme_bytes": estimate.nvme_bytes,
        "nvme_bytes_per_machine": estimate.nvme_bytes * per_node,
        "comm_bytes": communication_bytes(model, config, job.common["world_size"], cache),
        "step_s": speed.step_s,
        "tokens_per_s": speed.tokens_per_s,
        "device_fits": device_fits,
        "host_fits": host_fits,
        "fits": device_fits and host_fits,
    }


def setting_time(
    model: Any, config: FSDPConfig, job: SearchJob, finetune: Finetune, cache: dict[Any, Any] | None = None
) -> Any:
    """The step time of ``model`` (built for ``finetune``) under ``config`` on the job's link and GPU
    (``cache``: the search's, for the plan)."""
    world = job.common["world_size"]
    _, shard = config.mesh.resolve(world)
    plan = cached_plan(cache, model, config)
    seq = default_seq(model, job.common["seq"])
    return plan_step_time(
        model, plan, shard=shard, world_size=world, tokens_per_gpu=job.common["batch"] * seq, seq=seq,
        link=job.link, gpu=job.gpu, finetune=finetune.kind,  # type: ignore[arg-type]
        nf4=nf4_paths(model) if finetune.kind == "qlora" else (), optimizer=job.common["optimizer"],
        nvme_gb_per_s=NVME_GB_PER_S / job.ranks_per_node,  # one drive per machine
        schedule="cpu" if job.common["device"] == "cpu" else "cuda",  # what overlaps: the target's defaults
    )  # fmt: skip


def config_for_setting(base: FSDPConfig, settings: dict[str, Any], model: Any = None) -> FSDPConfig:
    """``base`` with a row's settings. ``offload_groups``: an int n offloads the n largest groups (``model``,
    the meta model the row was planned on, is then needed), ``"all"`` every group through the top level."""
    config = _settings_config(base, settings, "1")  # a budget only carries the kind: offload_largest drops it
    count = settings.get("offload_groups")
    if not settings["offload"] or not isinstance(count, int):
        return config
    if model is None:
        raise ValueError(f"offload_groups: {count} (the largest groups) needs the model to find them")
    chosen, planned = largest_groups(model, config)
    return offload_largest(config, chosen, count, planned)


def _settings_config(base: FSDPConfig, settings: dict[str, Any], budget: str) -> FSDPConfig:
    """``base`` with a row's settings; a per-group offload as an unresolved ``budget``."""
    data = base.model_dump(mode="json", by_alias=True)
    data["mixed_precision"] = (
        {"param_dtype": "bf16", "reduce_dtype": "fp32"}
        if settings["mixed_precision"] == "bf16"
        else {"param_dtype": None, "reduce_dtype": None}
    )
    for rule in data["wrap"]:
        rule.pop("mixed_precision", None)
        rule.pop("reshard_after_forward", None)
        rule.pop("offload", None)
        if rule.get("group") != "tied":  # an embedding or a head saves nothing worth recomputing
            rule["activation_checkpointing"] = settings["activation_checkpointing"]
    data["offload"] = _offload_section(settings, budget)
    data["reshard_after_forward"] = settings["reshard_after_forward"]
    data["schedule"]["forward_prefetch_depth"] = settings["forward_prefetch_depth"]
    return FSDPConfig.model_validate(data)


def _offload_section(settings: dict[str, Any], budget: str) -> dict[str, Any]:
    """The top-level ``offload`` of a row: its kind for every group, or as a budget for some of them."""
    kind, count = settings["offload"], settings.get("offload_groups")
    section: dict[str, Any] = {"device": "cpu" if kind else "none", "pin_memory": True}
    section["optimizer_only"] = kind == "optimizer"
    if kind and settings.get("optimizer_state") == "nvme":
        section.update(optimizer="nvme", nvme_path=settings.get("nvme_path") or DEFAULT_NVME_PATH)
    if kind and count != "all":  # some groups: the top level stays on the device, the budget picks them
        section.update(device="none", budget=budget)
    return section


def communication_bytes(model: Any, config: FSDPConfig, world_size: int, cache: dict[Any, Any] | None = None) -> int:
    """Bytes one rank sends per step in its collectives (a ring sends (n - 1) / n of the buffer of an
    n-rank all-gather or reduce-scatter): each group all-gathered over the shard group in forward,
    again in backward when resharded after forward (over k ranks for ``reshard_after_forward: k``;
    never the root's, which keeps its parameters by default), and reduce-scattered once. HSDP's
    replica all-reduce is the same in every setting searched and left out. A ``communication`` policy sends
    1-byte codes and a 4-byte scale per block instead (an all-to-all reduce-scatter sends what a ring
    reduce-scatter does: (n - 1) / n of the buffer). ``cache``: the search's, for the plan."""
    plan = cached_plan(cache, model, config)
    _, shard = config.mesh.resolve(world_size)
    total = 0.0
    for group, params in zip(plan.groups, plan.params):
        policy = group.policy
        param_dtype = policy.mixed_precision.param_dtype
        reduce_dtype = policy.mixed_precision.reduce_dtype or param_dtype
        numel = sum(p.numel() for p in params.values())
        trained = sum(p.numel() for p in params.values() if p.requires_grad)
        gather: float = numel * (element_size(param_dtype) if param_dtype is not None else 4)
        reduce: float = trained * (element_size(reduce_dtype) if reduce_dtype is not None else 4)
        comm = policy.communication  # CommPolicy: int8/fp8 codes plus one fp32 scale per block
        if comm.all_gather is not None:
            gather = numel * (1 + 4 / comm.block_size)
        if comm.reduce_scatter == "int8":
            reduce = trained * (1 + 4 / comm.block_size)
        ring = (shard - 1) / shard
        value = policy.reshard_after_forward
        if value == "auto":
            value = group.rule_index is not None and not policy.sharding.resident  # root and ZeRO-1/2 keep them
        backward_ranks = shard if value is True else (value if isinstance(value, int) and value > 1 else 1)
        total += gather * ring + gather * (backward_ranks - 1) / backward_ranks + reduce * ring
    return int(total)


def search_order(row: dict[str, Any]) -> tuple[Any, ...]:
    """Fastest first (to 0.1%: the model is not finer); among equals, the least offload (none, then
    optimizer_only, then full: host copies each step, host memory; some groups before all of them; the
    optimizer state in host memory before NVMe), then the smaller reserved peak."""
    return (-round(row["tokens_per_s"], -max(0, len(str(int(row["tokens_per_s"]))) - 3)),
            OFFLOADS.index(row["offload"]), row.get("offload_groups") == "all",
            row.get("optimizer_state") == "nvme", row["reserved_bytes"])  # fmt: skip


def nearest_rows(tried: list[dict[str, Any]], choice: dict[str, Any] | None, few: int = 5) -> list[dict[str, Any]]:
    """The chosen setting and its nearest alternatives: the next fastest fitting ones, and the fastest
    that do not fit (what a bigger budget would buy). Without a choice, the smallest reserved peaks
    (how far off the budget is)."""
    ordered = sorted(tried, key=search_order)
    if choice is None:
        return sorted(tried, key=lambda row: row["reserved_bytes"])[:few]
    fitting = [row for row in ordered if row["fits"] and row is not choice][: few - 3]
    faster = [row for row in ordered if not row["fits"] and row["tokens_per_s"] > choice["tokens_per_s"]][:2]
    return sorted([choice, *fitting, *faster], key=search_order)
