"""The command line's flags: one per `Settings` field a command uses, with its help, type
and default taken from the field, so a setting is described in one place.

Every default is SUPPRESSed (`add_flags`), so only what was typed overrides the
environment."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence

from pydantic import ByteSize

from megacache_client.wire import exitcodes
from megacache_server.settings import Settings

EPILOG = ("Flags override MEGACACHE_* environment variables, which override --env-file. "
          "Sizes take units (512MiB, 8GiB). " + exitcodes.describe() + ".")
#: flags of `serve` (and of the bare command), in --help order
SERVE_FLAGS = ("host", "port", "auth", "insecure", "workers", "data_dir", "index",
               "blob_store", "s3_bucket", "s3_prefix", "s3_endpoint", "s3_region", "s3_redirect",
               "max_blob_size", "store_budget", "min_free_disk", "log_level", "log_format")
#: where the maintenance commands find the storage they work on
STORAGE_FLAGS = ("data_dir", "index", "blob_store", "s3_bucket", "s3_prefix", "s3_endpoint",
                 "s3_region")
INDEX_FLAGS = ("data_dir", "index")  # tokens live in the index only
BOOLEAN_FLAGS = ("auth", "insecure", "s3_redirect")
METAVARS = {"max_blob_size": "SIZE", "store_budget": "SIZE", "min_free_disk": "SIZE",
            "workers": "N", "index": "URL", "s3_endpoint": "URL", "data_dir": "DIR"}
DEFAULTS_SHOWN = {"index": "sqlite:///<data-dir>/index.sqlite3", "data_dir": "./megacache-data"}


def add_flags(p: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Flags for Settings fields: help from the field, choices from its type, a human default.

    Every default is SUPPRESSed so only what was typed overrides the environment. The serve
    flags a command does not use are still accepted, hidden from its --help, so a script
    can pass one flag set to `serve` and to `token create` alike.
    """
    fields = Settings.model_fields
    for name in (*names, *(n for n in SERVE_FLAGS if n not in names)):
        flag = "--" + name.replace("_", "-")
        field = fields[name]
        shown = DEFAULTS_SHOWN.get(name) or _human_default(field.default)
        desc = (f"{field.description} (default {shown})" if name in names
                else argparse.SUPPRESS)
        if name in BOOLEAN_FLAGS:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=desc)
            continue
        choices = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal:
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, type=str.lower,
                           choices=choices, help=desc)
        else:
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=desc,
                           metavar=METAVARS.get(name, name.split("_")[-1].upper()))
    p.add_argument("--env-file", default=argparse.SUPPRESS, metavar="FILE",
                   help="read MEGACACHE_* settings from this file")


def _human_default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, ByteSize):
        return human_bytes(int(value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if str(value) else "unset"


def human_bytes(n: int) -> str:
    """8589934592 -> '8GiB': the largest binary unit that divides n exactly."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
