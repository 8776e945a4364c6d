"""What `dsflash serve MODEL` means: known bundle names and their profiles, Hub repo ids, local dirs, the default.

Pure data and string handling (no torch): `dsflash profiles` and `dsflash ps` import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dsflash.errors import ModelSourceError

DEFAULT_CONTEXT = 9216
DEFAULT_PROFILE = "default"
DEMO = "dsflash-demo-v4.1"  # trained here, shipped in the package (src/dsflash/train, data/demo-v4.1)
EMBEDDED = "dsflash-tiny-v4.1"  # random, with the real tokenizer, generated on first boot (tests, benchmarks)
# what `dsflash serve` (and `make serve`) serves without a MODEL argument: the model that answers
DEFAULT_MODEL = DEMO
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?$")


@dataclass(frozen=True)
class Profile:
    """A named serving setup of a bundle (tt-model's serve_profiles)."""

    name: str
    context: int
    description: str


@dataclass(frozen=True)
class Bundle:
    """A serving bundle: a pinned checkpoint plus its profiles (the first one is the default)."""

    name: str
    repo: str | None  # Hub repo id of the weights; None for the embedded and the packaged models
    revision: str | None
    profiles: tuple[Profile, ...]
    description: str
    packaged: str | None = None  # a checkpoint directory under dsflash/data shipped with the package

    @property
    def default_profile(self) -> Profile:
        return self.profiles[0]

    def profile(self, name: str | None) -> Profile:
        if name is None:
            return self.default_profile
        for p in self.profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.profiles)
        raise ModelSourceError(f"{self.name} has no profile {name!r} (profiles: {known})")


_DEFAULT = Profile(DEFAULT_PROFILE, DEFAULT_CONTEXT, "9216-token context, one sequence at a time")

BUNDLES: dict[str, Bundle] = {
    b.name: b
    for b in (
        Bundle(
            "rothgar/deepseek-v4.1-flash-p300x2",
            "deepseek-ai/DeepSeek-V4.1-Flash",
            "2cba9e42",
            (_DEFAULT, Profile("p300x2-32k", 33792, "33792-token context (long prompts; slower decode)")),
            "DeepSeek-V4.1-Flash for a QuietBox 2 (2x p300c, 4 Blackhole chips)",
        ),
        Bundle(
            DEMO,
            None,
            None,
            (_DEFAULT,),
            "small DeepSeek-V4.1 trained here (greets, says who it is, thinks and stops; see docs/performance.md)",
            packaged="demo-v4.1",
        ),
        Bundle(
            EMBEDDED,
            None,
            None,
            (_DEFAULT,),
            "tiny random DeepSeek-V4.1 in the official format with the real tokenizer, generated on first boot",
        ),
    )
}


@dataclass(frozen=True)
class ModelChoice:
    """A resolved MODEL argument: what to load, under which id, with which context."""

    model_id: str  # the id clients send and /v1/models lists
    source: str  # a Hub repo id[@revision], a local directory, or EMBEDDED
    profile: Profile
    bundle: Bundle | None = None
    aliases: tuple[str, ...] = field(default=())

    @property
    def embedded(self) -> bool:
        return self.source == EMBEDDED

    @property
    def ours(self) -> bool:
        """A model this package makes or ships (the generated and the packaged ones): its files change with a dsflash
        release, and its small store is rebuilt rather than refused when it was built from older ones. Decided by
        the directory, as gates decide it: the packaged model served by its path is ours too."""
        return self.embedded or (not _REPO_ID.match(self.source) and is_packaged(Path(self.source)))

    @property
    def slug(self) -> str:
        """A file-name-safe form of the id (state files, logs, cache dirs)."""
        return re.sub(r"[^A-Za-z0-9._-]+", "--", self.model_id).strip("-") or "model"


def choose(spec: str | None, profile: str | None = None) -> ModelChoice:
    """MODEL (or None for DEFAULT_MODEL) and --profile -> ModelChoice; unknown names fail with one line."""
    spec = spec or DEFAULT_MODEL
    bundle = BUNDLES.get(spec)
    if bundle is not None:
        prof = bundle.profile(profile)
        if bundle.packaged is not None:
            aliases = ("default",) if bundle.name == DEFAULT_MODEL else ()
            return ModelChoice(bundle.name, str(packaged_dir(bundle.packaged)), prof, bundle, aliases=aliases)
        if bundle.repo is None:
            aliases = ("default",) if bundle.name == DEFAULT_MODEL else ()
            return ModelChoice(bundle.name, EMBEDDED, prof, bundle, aliases=aliases)
        source = f"{bundle.repo}@{bundle.revision}"
        return ModelChoice(bundle.name, source, prof, bundle, aliases=(bundle.repo, source))
    generic = Bundle(spec, None, None, (_DEFAULT,), "")
    prof = generic.profile(profile)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path.resolve()
        return ModelChoice(path.name, str(path), prof, aliases=(str(path), spec))
    if _REPO_ID.match(spec) and not spec.startswith((".", "/", "~")):
        repo = spec.partition("@")[0]
        return ModelChoice(repo, spec, prof, aliases=(spec,))
    known = ", ".join(BUNDLES)
    raise ModelSourceError(
        f"{spec!r} is not a known bundle ({known}), a Hugging Face repo id (org/name[@revision]) or a directory"
    )


def packaged_dir(name: str) -> Path:
    """A checkpoint directory shipped inside the package (dsflash/data/NAME)."""
    return Path(str(resources.files("dsflash") / "data" / name))


def packaged_path(spec: str) -> Path | None:
    """The directory of a packaged bundle's name (dsflash-demo-v4.1), None for any other name."""
    bundle = BUNDLES.get(spec)
    return packaged_dir(bundle.packaged) if bundle is not None and bundle.packaged is not None else None


def is_packaged(path: Path) -> bool:
    """Whether a model directory is one the package ships (its files change with a release)."""
    return any(path.resolve() == packaged_dir(b.packaged).resolve() for b in BUNDLES.values() if b.packaged)
