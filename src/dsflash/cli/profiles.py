"""`dsflash profiles MODEL`: the serving profiles of a bundle (context length per profile) and the default."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "profiles",
        help="list a model's serving profiles",
        description="List the profiles `dsflash serve MODEL --profile P` accepts. Without MODEL: every known bundle.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="bundle name, Hub repo id or directory")
    p.set_defaults(run=run)


def run(args) -> int:
    from dsflash.service.catalog import BUNDLES, EMBEDDED, choose

    names = [args.model] if args.model else list(BUNDLES)
    for name in names:
        choice = choose(name)
        bundle = choice.bundle
        where = bundle.repo and f"{bundle.repo}@{bundle.revision}" if bundle else choice.source
        if choice.source == EMBEDDED:
            where = "embedded (generated on first boot)"
        elif bundle is not None and bundle.packaged is not None:
            where = "trained, shipped in the package"
        print(f"{choice.model_id}  ({where})")
        profiles = bundle.profiles if bundle else (choice.profile,)
        for i, prof in enumerate(profiles):
            mark = "  (default)" if i == 0 else ""
            print(f"  {prof.name:<12} {prof.context:>6} tokens  {prof.description}{mark}")
    return 0
