"""Break each core promise on purpose, one at a time, and check that the tests claiming it catch the break.

Each mutation replaces one exact piece of source text (the obvious way to break the promise) in a copy of the
tree (``git worktree`` at HEAD, the working tree untouched), runs the tests that claim the promise there, and
records whether they failed. A mutation whose text is not found is an error (the code moved: update the table).

    .venv/bin/python scripts/mutations.py            # every mutation; a table at the end; exit 1 if one survived
    .venv/bin/python scripts/mutations.py --only auth  # one by name

Several minutes per mutation on 2 cores (the trainer and resume tests start real torchrun ranks).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """One break: in ``path``, ``old`` becomes ``new``; ``tests`` (pytest arguments) must fail."""

    name: str
    promise: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "skip-resume",
        "a resume restores the weights and optimizer state exactly",
        "grpo_core/train/checkpoint.py",
        "    dcp.load(tensors, storage_reader=reader, planner=tensor_only_planner())",
        "    pass  # mutation: nothing loaded",
        ("tests/integration/test_resume_faults.py",),
    ),
    Mutation(
        "train-twice",
        "no prompt is trained twice across a resume",
        "grpo_core/transport/types.py",
        "        return prompt_index < self.first_untrained_prompt_index or prompt_index in self._trained_above",
        "        return False  # mutation: every prompt generated again",
        ("tests/integration/test_resume_faults.py", "tests/unit/rollout/test_prompt_shuffle.py"),
    ),
    Mutation(
        "any-token",
        "every listener refuses a request without the run's token",
        "grpo_core/security/auth.py",
        # the first lines of bearer_role, which every HTTP listener's check calls
        '        inference: the keys that grant inference only.\n    """\n'
        "    if not header_value:\n        return None",
        '        inference: the keys that grant inference only.\n    """\n'
        "    return ROLE_CONTROL  # mutation: any caller",
        (
            "tests/integration/test_security.py",
            "tests/integration/test_routing.py",
            "tests/unit/security/test_key_roles.py",
            "-k",
            "token or route or 401 or unauth or key",
        ),
    ),
    Mutation(
        "skip-manifest",
        "a checkpoint is checked against its manifest before any of it is read",
        "grpo_core/train/manifest.py",
        "    folder = Path(folder)\n    try:\n        manifest = json.loads((folder / MANIFEST_FILE).read_text())",
        "    return  # mutation\n    folder = Path(folder)\n    try:\n"
        "        manifest = json.loads((folder / MANIFEST_FILE).read_text())",
        ("tests/unit/train/test_checkpoint_manifest.py",),
    ),
    Mutation(
        "swap-rows",
        "each rank trains its own row of a micro-batch",
        "grpo_core/train/distributed.py",
        "            data = np.frombuffer(rows[r].to_ipc(), dtype=np.uint8)",
        "            data = np.frombuffer(rows[0].to_ipc(), dtype=np.uint8)  # mutation: rank 0's row everywhere",
        ("tests/unit/train/test_loss_normalization.py", "tests/integration/test_trainer.py"),
    ),
    Mutation(
        "flip-sign",
        "the loss is the clipped surrogate of DESIGN.md §5 (gradient ascent on the advantage)",
        "grpo_core/train/loss.py",
        "        per_term = torch.minimum(ratio * advantages, clipped * advantages)",
        "        per_term = torch.minimum(-ratio * advantages, -clipped * advantages)  # mutation",
        ("tests/unit/train/test_loss.py",),
    ),
    Mutation(
        "per-rank-normaliser",
        "the loss is normalised by the trained tokens of the whole step, every rank",
        "grpo_core/train/trainer.py",
        # the overlapped path (train.overlap_micro_batches, the default): the final divisors of the step
        "        scale = overlap_rescale(provisional, self.loss_normalisers(terms))",
        '        scale = overlap_rescale(provisional, self.loss_normalisers([int(r["terms"]) for r in local]))',
        ("tests/unit/train/test_loss_normalization.py",),
    ),
    Mutation(
        "ignore-eos",
        "the embedded server ends a sequence at EOS",
        "grpo_core/serving/embedded/engine.py",
        "(token in self.eos_token_ids and not seq.ignore_eos)",
        "(False and token in self.eos_token_ids)",
        ("tests/integration/test_serving_embedded.py",),
    ),
    Mutation(
        "no-stale-check",
        "no sample trains more than rollout.max_staleness versions behind its step",
        "grpo_core/train/planner.py",
        "        return policy_version - versions > self.max_staleness",
        "        return np.zeros(batch.num_rows, dtype=bool)  # mutation: nothing is stale",
        ("tests/unit/train/test_staleness_bound.py", "tests/unit/train/test_planner.py"),
    ),
)


def run(mutation: Mutation, tree: Path, timeout_s: float) -> tuple[bool, float, str]:
    """Apply ``mutation`` in ``tree``, run its tests, restore the file; returns ``(caught, seconds, last line)``."""
    path = tree / mutation.path
    source = path.read_text()
    if source.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the text to mutate is not found once in {mutation.path}; update it")
    path.write_text(source.replace(mutation.old, mutation.new))
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        return done.returncode != 0, time.monotonic() - started, last
    except subprocess.TimeoutExpired:
        return True, time.monotonic() - started, f"timed out after {timeout_s:.0f} s (counts as caught)"
    finally:
        path.write_text(source)


def main() -> int:
    """Entry point; returns the exit code (1 when a mutation survived)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these mutations (by name)")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    tree = Path(tempfile.mkdtemp(prefix="grpo-mutations-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"], cwd=ROOT, check=True)
    try:
        for built in ROOT.glob("packer_rs/_native*.so"):  # the extension this checkout built
            shutil.copy2(built, tree / "packer_rs" / built.name)
        if (ROOT / ".cache").is_dir():  # the converted and random models, built once
            (tree / ".cache").symlink_to(ROOT / ".cache")
        rows = []
        for mutation in chosen:
            caught, seconds, last = run(mutation, tree, args.timeout_s)
            rows.append((mutation, caught, seconds, last))
            print(f"{mutation.name}: {'caught' if caught else 'SURVIVED'} in {seconds:.0f} s ({last})", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print("\n| mutation | promise | tests | caught | s |\n|---|---|---|---|---|")
    for mutation, caught, seconds, _ in rows:
        tests = " ".join(t for t in mutation.tests if not t.startswith("-"))
        print(f"| {mutation.name} | {mutation.promise} | {tests} | {'yes' if caught else 'NO'} | {seconds:.0f} |")
    return 0 if all(caught for _, caught, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
