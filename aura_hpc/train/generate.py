"""Sampling from a run's newest valid checkpoint."""

from __future__ import annotations

from pathlib import Path

from aura_hpc.errors import CheckpointError
from aura_hpc.train.checkpoint import files as checkpoint


def generate(run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int, num: int = 1) -> list[str]:
    if max_new_tokens <= 0:
        raise CheckpointError(f"--max-new-tokens must be at least 1, got {max_new_tokens} (fix: --max-new-tokens 100)")
    if not temperature >= 0:  # nan too
        raise CheckpointError(f"--temperature must be 0 (greedy) or above, got {temperature} (fix: --temperature 0.8)")
    if num < 1 or top_k < 0:
        raise CheckpointError("--num must be at least 1 and --top-k 0 or more (fix: --num 1 --top-k 40)")
    root = Path(run_dir) / "checkpoints"
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist (fix: pass output_dir/run_name of a run)")
    ckpt = _newest_valid(root)
    import torch

    from aura_hpc.train.checkpoint.consolidate import consolidate
    from aura_hpc.train.model.language_model import load_pretrained, padding_suppressed
    from aura_hpc.train.process.deepspeed_import import quiet_deepspeed

    quiet_deepspeed()
    try:
        consolidate(ckpt.path)  # a sharded checkpoint (not a run's last) holds no full weights yet
    except CheckpointError as exc:
        raise _went_away(ckpt.path, str(exc).split(" (fix: ")[0][:200]) or exc from None
    except OSError as exc:  # its marker, read again to list the weights, gone or unreadable
        why = f"{type(exc).__name__}: {exc}"[:200]
        raise _went_away(ckpt.path, why) or CheckpointError(
            f"checkpoint {ckpt.path.name} could not be read ({why}) (fix: check the storage and try again)"
        ) from None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # The samples are this command's output: no weight-loading progress bar or notices in it.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    try:
        tok = AutoTokenizer.from_pretrained(str(ckpt.path / "tokenizer"))
        model = load_pretrained(str(ckpt.path / "model"))
    except OSError as exc:  # transformers says OSError for a file gone too
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if gone := _went_away(ckpt.path, why):
            raise gone from None
        raise CheckpointError(
            f"checkpoint {ckpt.path.name} cannot be loaded ({why}) (fix: move it away to use the one before it)"
        ) from None
    model.eval()
    torch.manual_seed(seed)
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:  # an empty prompt: a new document, as GPT-2 starts one (transformers refuses no tokens)
        ids = torch.tensor([[tok.eos_token_id]])
    room = int(model.config.n_positions)
    if ids.shape[1] + max_new_tokens > room:
        fix = f"--max-new-tokens {room - ids.shape[1]}" if ids.shape[1] < room else "a shorter --prompt"
        raise CheckpointError(
            f"the prompt is {ids.shape[1]} tokens and --max-new-tokens {max_new_tokens}: more than the model's "
            f"{room} positions (fix: {fix})"
        )
    # Temperature 0 is greedy decoding, as most tools read it: the most likely token each time (transformers
    # refuses a temperature of 0 for sampling, and warns on one given without it).
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    out = []
    with torch.no_grad():
        for _ in range(num):
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                **sampling,
                pad_token_id=tok.eos_token_id,
                **padding_suppressed(model, len(tok)),
            )
            out.append(tok.decode(gen[0], skip_special_tokens=True))
    return out


def _went_away(ckpt: Path, why: str) -> CheckpointError | None:
    """The error for checkpoint `ckpt` pruned by its run while this read it, or None while it is still there (the
    failure then is the checkpoint's own: its fix, not "free space" or "use an earlier one")."""
    if (ckpt / checkpoint.MARKER).exists():
        return None
    return CheckpointError(
        f"checkpoint {ckpt.name} went away while it was read ({why}): its run keeps only train.keep_last of them "
        "(fix: run generate again, it reads the newest)"
    )


def _newest_valid(root: Path) -> checkpoint.Checkpoint:
    """The newest checkpoint that verifies. Read only: a training run may be pruning or writing this folder
    (a file gone mid-check was a traceback), and what fails here is not set aside as corrupt, as a resume does."""
    problems = []
    for ckpt in checkpoint.list_complete(root):
        problem = checkpoint.verify(ckpt.path)
        if problem is None:
            return ckpt
        problems.append(f"{ckpt.path.name}: {problem}")
    if problems:
        raise CheckpointError(
            f"no checkpoint in {root} verifies ({'; '.join(problems[:3])}) (fix: if the storage failed to read, check it and "
            "try again; otherwise resume the run, which sets damaged ones aside)"
        )
    raise CheckpointError(f"no complete checkpoint in {root} (fix: train first: python -m aura_hpc local)")
