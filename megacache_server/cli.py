"""`megacache-server`: run the service.

Flags override `MEGACACHE_*` environment variables, which override `--env-file`. Worker
processes receive the merged settings through the environment, so one code path serves
one worker or many.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from megacache_server.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacache-server",
        description="Remote compile cache for PyTorch 2 (content-addressed Mega-Cache bundles).",
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the HTTP service (the default command)")
    _add_serve_flags(serve)
    _add_serve_flags(parser)
    return parser


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    fields = Settings.model_fields
    for name in ("host", "port", "data_dir", "index", "blob_store", "s3_bucket", "s3_prefix",
                 "s3_endpoint", "s3_region", "s3_redirect", "max_blob_size", "store_budget",
                 "min_free_disk", "workers", "log_level"):
        flag = "--" + name.replace("_", "-")
        env = "MEGACACHE_" + name.upper()
        p.add_argument(flag, dest=name, default=argparse.SUPPRESS,
                       help=f"{fields[name].description} [env {env}, default "
                            f"{fields[name].default}]")
    p.add_argument("--env-file", default=argparse.SUPPRESS,
                   help="read MEGACACHE_* settings from this file")


def load_settings(args: argparse.Namespace) -> Settings:
    values = {k: v for k, v in vars(args).items() if k not in ("command", "env_file")}
    env_file = getattr(args, "env_file", None)
    return Settings(_env_file=env_file, **values)  # type: ignore[call-arg]


def serve(settings: Settings) -> None:
    import uvicorn

    _export(settings)
    print(
        f"megacache-server: http://{settings.host}:{settings.port}  data={settings.data_dir}  "
        f"index={settings.index_url()}  workers={settings.workers}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        "megacache_server.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        timeout_keep_alive=30,
    )


def _export(settings: Settings) -> None:
    """Hand the merged settings to uvicorn worker processes."""
    for name, value in settings.model_dump(exclude_none=True).items():
        os.environ["MEGACACHE_" + name.upper()] = str(value)
    data_dir = settings.data_dir.resolve()
    os.environ["MEGACACHE_DATA_DIR"] = str(data_dir)
    os.environ["MEGACACHE_INDEX"] = settings.index or f"sqlite:///{data_dir / 'index.sqlite3'}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(f"megacache-server: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if args.command in (None, "serve"):
        serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
