"""What is refused before anything costly (a download, a build, an engine start): a golden that
does not apply, a TP size or head config vLLM would fail on. Host side; each refusal is exit 2
with one line naming what is wrong and the fix."""

from __future__ import annotations

from pathlib import Path

from validate import compat, device_class, goldens, profiles, prompt_sets, request
from validate.contract import BadInput


def golden(given: str | None, profile: profiles.Profile) -> None:
    """``--golden FILE`` refused unless it can be read and is of this profile, TP and (on CPU,
    where the host can tell) device class: falling back to the floors would hide that the golden
    asked for was never used."""
    if given in (None, "auto", "none"):
        return
    path = Path(given)
    hint = goldens.regenerate_hint(profile.name, profile.tensor_parallel_size)
    if not path.is_file():
        raise BadInput(f"--golden {given}: no such file; pass a golden from "
                       f"validate/data/goldens/, `--golden auto` (the one for this machine), or "
                       f"make one with {hint}")
    problem = goldens.mismatch(goldens.load(path, regenerate=hint), profile=profile.name,
                               tp=profile.tensor_parallel_size,
                               device_class=device_class.cpu() if profile.device == "cpu" else None)
    if problem:
        raise BadInput(f"--golden {given} does not apply: {problem}; use `--golden auto`, or make "
                       f"one with {hint}")


def models(profile: profiles.Profile, target: str, draft: str,
           refused: str = "refused before starting any engine") -> None:
    """What vLLM would fail on at this TP size (compat), said before anything costly."""
    problems = compat.head_problems(Path(draft)) + compat.tp_problems(
        Path(target), profile.tensor_parallel_size)
    if problems:
        raise BadInput(f"{refused}:\n  - " + "\n  - ".join(problems))


def serving(req: request.Run) -> None:
    """The serving bench's request: a profile with a bench set whose file is its pinned bytes
    (exit 7 otherwise, naming the file), a live reference, a sweep that can run; said before a
    download, a build or a server start."""
    if req.path != "serving":
        return
    profile = req.profile
    if not profile.bench_set:
        raise BadInput(f"profile {profile.name} names no bench_set (validate/data/profiles.toml); "
                       f"bench one that does: "
                       f"{', '.join(n for n in profiles.names() if profiles.get(n).bench_set)}")
    if req.full or req.reference == "golden" or req.golden not in (None, "auto", "none"):
        raise BadInput("bench runs both servers and judges against the profile's floor (the "
                       "serving path has no golden yet): drop --full, --reference golden and "
                       "--golden FILE")
    prompt_sets.load(profile.bench_set)  # prompt_sets.Mismatch: exit 7, naming the file


def nodes(req: request.Run) -> None:
    """A profile beyond one node: on CPU its nodes are containers the kit starts (``--container``);
    the serving bench spans one node only (for now)."""
    profile = req.profile
    if profile.nodes == 1:
        return
    if req.path == "serving":
        raise BadInput(f"the serving bench runs on one node; profile {profile.name} spans "
                       f"{profile.nodes}: bench a one-node profile")
    if profile.device == "cpu" and not req.container:
        raise BadInput(f"profile {profile.name} spans {profile.nodes} nodes: rehearse it with "
                       f"--container (one container a node, a Ray cluster across them): "
                       f"`python -m validate rehearse --profile {profile.name} --container`")
    if profile.device == "cuda" and req.container:
        raise BadInput(f"profile {profile.name} spans {profile.nodes} GPU machines: start the "
                       "pinned image with a Ray node on each, then run the kit inside the head's "
                       "container with --no-container (docs/multi-node.md)")
