"""One training run through another tool, on this rank, with torch's fully_shard or fsdp2lite's.

    torchrun --standalone --nproc-per-node 2 tests/integrations/tool_runs.py TOOL OUT MODEL_DIR

TOOL: transformers (native FSDP2 via distributed_config, trained by the HF Trainer), accelerate
(Accelerate's FSDP2 preparation), lightning (ModelParallelStrategy). Each implementation runs in turn
in the same processes: torch's fully_shard first (nothing patched), then fsdp2lite's (and for
accelerate, install() with a policy file, OUT/../llama_blocks.yaml), undoing the patch after. Each rank
writes OUT/rank{r}.json: per implementation, the losses of an uninterrupted run, the losses after
resuming from a checkpoint saved mid-run, and what the tool saw. tests/test_integrations.py compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STEPS, RESUME_AT = 4, 2


def batches(n: int, seq: int = 12, vocab: int = 96) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (seq,), generator=g) for _ in range(n)]


def finish(out: Path, result: dict[str, Any]) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- transformers: from_pretrained(distributed_config=...) + Trainer --------------------------------
def run_transformers(impl: str, out: Path, model_dir: str) -> dict[str, Any]:
    """transformers refuses the Trainer's own resume for models sharded at load time, so the checkpoint
    is DCP (model and optimizer), saved by a callback mid-run and loaded by one at the resumed start."""
    if impl != "torch":
        import fsdp2lite as fl

        fl.patch()  # before model classes are imported: transformers binds the names then
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, DistributedConfig, Trainer, TrainerCallback, TrainingArguments

    class InOrder(Trainer):  # the same batches in the same order on every run
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    class Checkpoint(TrainerCallback):
        def __init__(self, save_at: int | None, load: bool) -> None:
            self.save_at, self.load = save_at, load

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any
        ) -> None:  # noqa: E501
            if self.load:
                _dcp_load(out / "dcp", model, optimizer)

        def on_step_end(
            self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any
        ) -> None:  # noqa: E501
            if state.global_step == self.save_at:
                _dcp_save(out / "dcp", model, optimizer)

    def train(steps: int, data: list[dict[str, torch.Tensor]], callback: Any) -> tuple[Any, list[float]]:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(fsdp_size=2), dtype=torch.float32
        )
        args = TrainingArguments(
            output_dir=str(out / "trainer"), per_device_train_batch_size=2, max_steps=steps, learning_rate=5e-3,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0,
            use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        trainer = InOrder(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    data = [{"input_ids": t, "labels": t} for t in batches(32)]
    model, losses = train(STEPS, data, Checkpoint(RESUME_AT, load=False))
    seen = {"type": type(model).__name__, "fsdp_module": _is_torch_fsdp_module(model), "impl": _impl_of(model)}
    prompt = batches(1, seq=5)[0].unsqueeze(0)
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain.load_state_dict(_full_state_dict(model))
    unsharded = plain.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
    consumed = RESUME_AT * 2 * dist.get_world_size()  # samples of the steps before the checkpoint
    _, resumed = train(STEPS - RESUME_AT, data[consumed:], Checkpoint(None, load=True))
    return {"losses": losses, "resumed": resumed, "generated": generated, "unsharded": unsharded, "seen": seen}


# ---- Accelerate: its FSDP2 preparation, driven on CPU --------------------------------------------
def run_accelerate(impl: str, out: Path, model_dir: str) -> dict[str, Any]:
    """Accelerate runs FSDP only on accelerators (on CPU it falls back to DDP), so on CPU its state is set
    to FSDP after construction (``enable_fsdp_on_cpu``); ``prepare`` and ``backward`` are Accelerate's
    own. The checkpoint is DCP, as in the transformers run."""
    if impl.startswith("fsdp2lite") and impl != "fsdp2lite-config":
        from fsdp2lite.integrations import accelerate as fl_accelerate

        fl_accelerate.install()
    elif impl == "fsdp2lite-config":
        from fsdp2lite.integrations import accelerate as fl_accelerate

        fl_accelerate.install(out.parent.parent / "llama_blocks.yaml")
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    from fsdp2lite.integrations.accelerate import enable_fsdp_on_cpu

    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32}
    bf16 = bf16 if impl.endswith("-bf16") else None  # Accelerate wants all three keys
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        mixed_precision_policy=bf16,
    )  # fmt: skip
    accelerator = Accelerator(cpu=True)
    enable_fsdp_on_cpu(accelerator, plugin)  # Accelerate enables FSDP on accelerators only

    def prepared() -> tuple[Any, Any]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        return accelerator.prepare(model, optimizer)

    def step(model: Any, optimizer: Any, index: int) -> float:
        tokens = torch.stack(batches(2 * STEPS * 2)[index * 4 + 2 * dist.get_rank() :][:2])
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / dist.get_world_size()

    model, optimizer = prepared()
    seen = {"type": type(model).__name__, "fsdp_module": _is_torch_fsdp_module(model), "impl": _impl_of(model),
            "groups": sum(1 for m in model.modules() if _is_torch_fsdp_module(m))}  # fmt: skip
    losses = []
    for index in range(STEPS):
        losses.append(step(model, optimizer, index))
        if index + 1 == RESUME_AT:
            _dcp_save(out / "dcp", model, optimizer)
    model, optimizer = prepared()
    _dcp_load(out / "dcp", model, optimizer)
    resumed = [step(model, optimizer, index) for index in range(RESUME_AT, STEPS)]
    return {"losses": losses, "resumed": resumed, "seen": seen}


# ---- Lightning: ModelParallelStrategy, fully_shard in configure_model ----------------------------
def run_lightning(impl: str, out: Path, model_dir: str) -> dict[str, Any]:
    """Two epochs of two steps; Lightning's own distributed checkpoint after the first, and a second
    Trainer resumed from it (``fit(ckpt_path=...)``) runs the second epoch."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy
    from transformers import AutoModelForCausalLM

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp2lite import fully_shard

    class LitLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            self.losses.append(mean.item() / dist.get_world_size())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=5e-3)

        def train_dataloader(self) -> Any:  # this epoch's batches, this rank's half (no sampler)
            rank, epoch = dist.get_rank(), self.current_epoch
            tokens = batches(2 * STEPS * 2)
            mine = [torch.stack(tokens[(epoch * RESUME_AT + i) * 4 + 2 * rank :][:2]) for i in range(RESUME_AT)]
            return torch.utils.data.DataLoader(mine, batch_size=None)  # each item is a batch

    class SaveAfterFirstEpoch(pl.Callback):
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(str(out / "lightning.ckpt"))

    def trainer(callbacks: list[Any]) -> Any:
        return pl.Trainer(
            accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            max_epochs=STEPS // RESUME_AT, reload_dataloaders_every_n_epochs=1, use_distributed_sampler=False,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=callbacks,
        )  # fmt: skip

    module = LitLlama()
    trainer([SaveAfterFirstEpoch()]).fit(module)
    seen = {"type": type(module.model).__name__, "fsdp_module": _is_torch_fsdp_module(module.model),
            "impl": _impl_of(module.model)}  # fmt: skip
    resumed = LitLlama()
    trainer([]).fit(resumed, ckpt_path=str(out / "lightning.ckpt"))
    return {"losses": module.losses, "resumed": resumed.losses, "seen": seen}


def _dcp_save(path: Path, model: Any, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))


def _dcp_load(path: Path, model: Any, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _is_torch_fsdp_module(model: Any) -> bool:
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_home  # torch's class, even when patched

    return isinstance(model, torch_home.FSDPModule)


def _impl_of(model: Any) -> str:
    return "fsdp2lite" if "_fsdp_state" in model.__dict__ else "torch"


IMPLS = {"transformers": ("torch", "fsdp2lite"), "lightning": ("torch", "fsdp2lite"),
         "accelerate": ("torch", "fsdp2lite", "fsdp2lite-config", "torch-bf16", "fsdp2lite-bf16")}  # fmt: skip


def main() -> None:
    tool, out, model_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    runs = {"transformers": run_transformers, "accelerate": run_accelerate, "lightning": run_lightning}
    results = {}
    for impl in IMPLS[tool]:
        torch.manual_seed(0)
        (out / impl).mkdir(parents=True, exist_ok=True)
        try:
            results[impl] = runs[tool](impl, out / impl, model_dir)
        finally:
            _undo_patches()
    finish(out, results)


def _undo_patches() -> None:
    import fsdp2lite as fl

    if "accelerate" in sys.modules:
        from fsdp2lite.integrations import accelerate as fl_accelerate

        fl_accelerate.uninstall()
    fl.unpatch()


if __name__ == "__main__":
    main()
