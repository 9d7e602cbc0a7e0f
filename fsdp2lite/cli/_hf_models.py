"""What ``--model`` names, for ``explain``, ``estimate`` and ``migrate``: a factory (``pkg.module:fn``),
or a Hugging Face causal LM described by its config, built on the meta device with
``AutoModelForCausalLM.from_config`` (no weights, nothing downloaded):

    --model path/to/model_dir          a directory with config.json (a save_pretrained or hub snapshot)
    --model path/to/config.json        the config file itself
    --model hf:meta-llama/Llama-3.1-8B a hub id, resolved from the local Hugging Face cache only
    --model llama-3-70b                a preset shape (PRESETS: the published configs' numbers)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._args import UsageError

# Shapes of published models (their config.json numbers), for planning without any download.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False},
    # examples/train.py's toy preset (its --model-config llama-tiny, a random init): the planner's rehearsal
    "llama-tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}  # fmt: skip
TRAIN_PRESETS = ("llama-tiny",)  # the presets examples/train.py builds itself (--model-config NAME)
_LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
FORMS = (
    "'pkg.module:factory', a Hugging Face model directory or config.json, 'hf:ORG/NAME' (local cache only), "
    f"or a preset ({', '.join(PRESETS)})"
)


def is_hf_spec(spec: str) -> bool:
    """Whether ``spec`` names a Hugging Face config rather than a ``module:factory``."""
    return spec.startswith("hf:") or spec in PRESETS or Path(spec).exists() or spec.endswith(".json")


def hf_factory(spec: str, prog: str) -> Callable[[], Any]:
    """A no-argument function building the causal LM ``spec`` describes (called under the meta device)."""
    transformers = _transformers(spec, prog)
    config = _config(transformers, spec, prog)

    def build() -> Any:
        return transformers.AutoModelForCausalLM.from_config(config)

    build.__name__ = f"AutoModelForCausalLM.from_config[{spec}]"
    return build


def _transformers(spec: str, prog: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UsageError(
            f'argument --model: {spec!r} is a Hugging Face model; that needs transformers: pip install -e ".[hf]" '
            "from a clone of fsdp2lite (or pip install transformers)",
            prog,
        ) from None
    return transformers


def _config(transformers: Any, spec: str, prog: str) -> Any:
    if spec in PRESETS:
        return transformers.LlamaConfig(**{**_LLAMA3, **PRESETS[spec]})
    try:
        if spec.startswith("hf:"):
            return transformers.AutoConfig.from_pretrained(spec[3:], local_files_only=True)
        path = Path(spec)
        if not path.exists():  # a local path: never looked up on the hub (that waits on the network)
            raise OSError(f"no such file or directory: {spec}")
        if path.is_dir() or path.name == "config.json":
            return transformers.AutoConfig.from_pretrained(str(path if path.is_dir() else path.parent))
        data = transformers.PretrainedConfig.get_config_dict(str(path))[0]
        return transformers.AutoConfig.for_model(**data)
    except OSError as exc:
        where = "is not in the local Hugging Face cache (nothing is downloaded; fetch its config.json first)"
        problem = (
            where if spec.startswith("hf:") else f"has no readable config.json ({' '.join(str(exc).split())[:160]})"
        )
        raise UsageError(f"argument --model: {spec!r} {problem}; expected {FORMS}", prog) from None
    except (ValueError, KeyError) as exc:
        raise UsageError(f"argument --model: {spec!r} is not a config transformers knows: {exc}", prog) from None
