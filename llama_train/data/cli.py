"""`llama-data`: train a tokenizer, prepare packed shards, inspect a prepared directory.

    llama-data train-tokenizer --source builtin --vocab-size 8192 --out tok/llama8k
    llama-data prepare --source 'data/*.jsonl' --vocab-size 8192 --num-proc 2
    llama-data prepare --config configs/data/local_files.yaml --tokenizer tok/llama8k.model
    llama-data prepare --config configs/data/mixture.yaml --vocab-size 8192   (data.mixture)
    llama-data info ~/.cache/llama_train/builtin-0123456789 --verify

Every `prepare` option is a DataConfig field (same names as configs/data/*.yaml, with dashes).
Unset options take llama-train's defaults (configs/data/builtin.yaml, its default data group), so
`llama-data prepare --source 'x/*.jsonl' --vocab-size V` prepares exactly the directory that
`llama-train data.source='x/*.jsonl' model.vocab_size=V` then finds and reuses. Quote globs: the
shell would expand them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import typing
from typing import Any, Optional

from .config import DataConfig
from .errors import DataError


def _field_type(f: dataclasses.Field) -> tuple[Any, bool]:
    """(base type, optional?) of a DataConfig field annotation."""
    hints = typing.get_type_hints(DataConfig)
    t = hints[f.name]
    args = typing.get_args(t)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return t, False


def _none_or(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = conv.__name__
    return parse


def add_config_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One --option per DataConfig field (default: unset, so --config/yaml values survive)."""
    for f in dataclasses.fields(DataConfig):
        if f.name in skip or f.name == "mixture":  # a list of entries: from --config's yaml
            continue
        base, optional = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_ = f"(default: {default})"
        if base is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            conv = _none_or(base) if optional else base
            p.add_argument(flag, dest=f.name, type=conv, default=argparse.SUPPRESS, help=help_)


def config_from_args(args: argparse.Namespace) -> DataConfig:
    """--config (default: llama-train's default data group), then the options given."""
    from omegaconf import OmegaConf

    from llama_train.paths import CONFIG_DIR

    path = getattr(args, "config", None) or CONFIG_DIR / "data" / "builtin.yaml"
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(loaded, dict):
        raise DataError(f"--config {path}: expected a mapping of DataConfig fields")
    values: dict[str, Any] = dict(loaded)
    for f in dataclasses.fields(DataConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return DataConfig.from_any(values)


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from .sources import open_source
    from .tokenizer import Tokenizer, train_tokenizer

    cfg = config_from_args(args)
    t0 = time.perf_counter()
    path = train_tokenizer(
        open_source(cfg).iter_texts(), args.vocab_size, args.out,
        max_sentences=cfg.tokenizer_max_sentences, seed=cfg.seed,
        max_line_bytes=cfg.tokenizer_max_line_bytes, source=f"data.source={cfg.source!r}",
    )
    tok = Tokenizer(path)
    print(json.dumps({"tokenizer": path, "vocab_size": tok.vocab_size, "sha256": tok.sha256,
                      "seconds": round(time.perf_counter() - t0, 2)}, indent=1))
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .prepare import prepare_data

    if args.out is not None:
        args.prepared_dir = args.out
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    prep = prepare_data(cfg, args.vocab_size)
    m = prep.meta
    print(json.dumps({
        "dir": prep.dir,
        "created": prep.created,
        "tokenizer": prep.tokenizer_path,
        "tokenizer_sha256": m["tokenizer"]["sha256"],
        "vocab_size": m["vocab_size"],
        "dtype": m["dtype"],
        **({"documents": m["documents"]} if "documents" in m else {}),
        **({"sources": [{k: s[k] for k in ("name", "weight", "dir", "train_tokens")}
                        for s in m["sources"]]} if "sources" in m else {}),
        "tokens": {s: v["tokens"] for s, v in m["splits"].items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }, indent=1))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .mixture import read_mixture_meta
    from .packed import PackedTokens

    mixture = read_mixture_meta(args.dir)
    if mixture is not None:  # data.mixture: the mixture, then each source's own info
        print(json.dumps({"dir": args.dir, "mixture": [
            {"name": s["name"], "weight": s["weight"], "dir": s["dir"]}
            for s in mixture["sources"]], "tokenizer_sha256": mixture["tokenizer"]["sha256"]},
            indent=1))
        for s in mixture["sources"]:
            _cmd_info(argparse.Namespace(**{**vars(args), "dir": s["dir"]}))
        return 0
    splits = {}
    meta = None
    for split in ("train", "val"):
        pt = PackedTokens(args.dir, split, verify=args.verify)
        meta = pt.meta
        splits[split] = {"tokens": len(pt), "documents": meta["splits"][split]["documents"],
                         "shards": len(pt.shards)}
    assert meta is not None
    print(json.dumps({"dir": args.dir, "vocab_size": meta["vocab_size"], "dtype": meta["dtype"],
                      "tokenizer_sha256": meta["tokenizer"]["sha256"], "source": meta["source"]["source"],
                      "splits": splits, "verified_sha256": bool(args.verify),
                      # None: prepared before block checksums; each shard is then checked whole
                      "block_checksums": meta.get("block_checksums")}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train-tokenizer", help="train a LLaMA-style SentencePiece BPE model")
    t.add_argument("--config", help="a configs/data/*.yaml to start from")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="model prefix: writes <out>.model")
    add_config_args(t, skip=("tokenizer", "prepared_dir", "val_fraction", "add_bos", "dtype", "num_proc",
                             "shard_tokens", "num_workers", "verify"))
    t.set_defaults(func=_cmd_train_tokenizer)

    q = sub.add_parser("prepare", help="tokenize a source into packed shards (idempotent)")
    q.add_argument("--config", help="a configs/data/*.yaml to start from")
    q.add_argument("--vocab-size", type=int, default=None,
                   help="model vocab size (trains a tokenizer of this size if --tokenizer is not given)")
    q.add_argument("--out", default=None, help="alias of --prepared-dir")
    add_config_args(q)
    q.set_defaults(func=_cmd_prepare)

    i = sub.add_parser("info", help="describe (and with --verify, checksum) a prepared directory")
    i.add_argument("dir")
    i.add_argument("--verify", action="store_true",
                   help="check every shard's sha256 (and its block checksum file's)")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except DataError as e:
        print(f"llama-data: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
