"""`python -m pipeline.answers save|upgrade|check`: the command line of the answer store
(pipeline/regen/answer_store.py). It sits on the entry floor because `upgrade` and `check` compose the config as
pipeline.run does."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from pipeline.regen import answer_store


def compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from pipeline.run import to_typed

    overrides = list(overrides)
    if not any(o.startswith("name=") for o in overrides):  # `name` is Hydra's experiment choice in a run
        experiment = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), "demo")
        overrides.append(f"name={experiment}")
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return to_typed(compose("config", overrides=overrides))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=answer_store.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    s = sub.add_parser("save", help="copy a regen folder's answers into the store")
    s.add_argument("regen_dir", type=Path)
    s.add_argument("store_dir", type=Path)
    for name, what in (("upgrade", "give an older store's conversations their digests (the config it was saved "
                                    "under)"),
                       ("check", "what a regen of this config would restore, without generating")):
        p = sub.add_parser(name, help=what)
        p.add_argument("store_dir", type=Path)
        p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pipeline.run: experiment=<name> ...")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.action == "save":
        print(json.dumps(answer_store.save(args.regen_dir, args.store_dir)))
    elif args.action == "upgrade":
        print(json.dumps(answer_store.upgrade(args.store_dir, compose(args.overrides))))
    else:
        result = answer_store.check(args.store_dir, compose(args.overrides))
        print(json.dumps({**result, "changed": result["changed"][:20]}, indent=1))


if __name__ == "__main__":
    main()
