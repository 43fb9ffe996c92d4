"""How every command runs: settings merged and checked, storage opened, failures as exit
codes.

Flags override `MEGACACHE_*` environment variables, which override `--env-file`
(`load_settings`); a command that needs the settings gets them through `configured`, after a
warning for each unknown variable. One that works on the store is wrapped by `on_storage`,
which checks the settings and the storage first and hands it the cache service; its
failures end it with `CommandFailed`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import functools
import importlib.util
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from pydantic import ValidationError

from megacache_client.wire.environment import client_variables
from megacache_client.wire.exitcodes import ExitCode
from megacache_server.api import supervisor
from megacache_server.errors import ApiError
from megacache_server.service.caching.cache import Cache
from megacache_server.settings import Settings
from megacache_server.store.storage import (
    Storage,
    build_storage,
    local_paths,
    removed_on_failure,
)


class CommandFailed(Exception):
    """Ends a command: `main` prints the message (after `megacache-server: `) on stderr and
    exits with the code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings merged: the flags typed (their defaults are suppressed, `flags`) over
    `MEGACACHE_*` variables over `--env-file`."""
    values = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    env_file = getattr(args, "env_file", None)
    return Settings(_env_file=env_file, **values)  # type: ignore[call-arg]


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One warning per MEGACACHE_* variable that neither the server nor the client reads.

    pydantic-settings ignores them silently, so a typo (`MEGACACHE_STORE_BUGDET`) would
    otherwise leave a setting at its default with nothing said.
    """
    known = {"MEGACACHE_" + n.upper() for n in Settings.model_fields}
    known |= client_variables()
    known |= {supervisor.SUPERVISOR_ENV}
    warnings = []
    for name in sorted(environ):
        if name.startswith("MEGACACHE_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"megacache-server: warning: {name} is not a megacache setting; "
                            f"ignored{hint}")
    return warnings


def settings_errors(exc: ValidationError) -> str:
    """pydantic's errors as `MEGACACHE_NAME: what is wrong (got 'value')`, one per problem."""
    parts = []
    for err in exc.errors():
        name = "MEGACACHE_" + str(err["loc"][0]).upper() if err["loc"] else "settings"
        parts.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


def configured(args: argparse.Namespace) -> Settings:
    """The merged settings of a command that needs them, after a warning for each unknown
    MEGACACHE_* variable; CONFIG when they cannot work."""
    for warning in unknown_environment(os.environ):
        print(warning, file=sys.stderr)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        raise CommandFailed(ExitCode.CONFIG,
                            f"invalid settings: {settings_errors(exc)}") from None
    if settings.blob_store == "s3" and importlib.util.find_spec("boto3") is None:
        raise CommandFailed(ExitCode.CONFIG, "--blob-store s3 needs boto3: "
                            "pip install 'megacache[server,s3]'")
    return settings


async def storage_problem(settings: Settings, *, with_blobs: bool = True) -> str | None:
    """Why the configured index or blob store cannot be used now, or None. Storage found
    unusable leaves nothing created on disk (no empty data dir beside a dead index)."""
    try:
        with removed_on_failure(local_paths(settings, with_blobs=with_blobs)):
            async with opened_storage(settings, with_blobs=with_blobs) as storage:
                for part in (storage.blobs, storage.index) if with_blobs else (storage.index,):
                    await part.ping()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.asynccontextmanager
async def opened_storage(settings: Settings, *, with_blobs: bool = True
                         ) -> AsyncIterator[Storage]:
    """The configured storage, opened for a maintenance command and closed after it."""
    storage = build_storage(settings, with_blobs=with_blobs)
    await storage.open()
    try:
        yield storage
    finally:
        await storage.close()


@contextlib.asynccontextmanager
async def opened_cache(settings: Settings, *, with_blobs: bool = True
                       ) -> AsyncIterator[Cache]:
    """The cache service over the configured storage: what every maintenance command uses."""
    async with opened_storage(settings, with_blobs=with_blobs) as storage:
        yield Cache(settings, storage)


StorageCommand = Callable[[Cache, argparse.Namespace], Awaitable[int]]


def on_storage(command: StorageCommand, *, with_blobs: bool = True
               ) -> Callable[[argparse.Namespace], int]:
    """A command run on the configured storage through the cache service: settings checked,
    storage reachable (else UNAVAILABLE), opened for the command and closed after it. A
    refusal of the service ends it with UNAVAILABLE when storage is down (503), else
    PROBLEM. A command that fails leaves nothing it created (`removed_on_failure`)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        settings = configured(args)

        async def on_cache() -> int:
            async with opened_cache(settings, with_blobs=with_blobs) as cache:
                return await command(cache, args)

        with removed_on_failure(local_paths(settings, with_blobs=with_blobs)):
            problem = asyncio.run(storage_problem(settings, with_blobs=with_blobs))
            if problem:
                raise CommandFailed(ExitCode.UNAVAILABLE, f"storage unavailable: {problem}")
            try:
                return asyncio.run(on_cache())
            except ApiError as exc:
                raise CommandFailed(ExitCode.UNAVAILABLE if exc.status == 503
                                    else ExitCode.PROBLEM, exc.message) from exc

    return run


def on_index(command: StorageCommand) -> Callable[[argparse.Namespace], int]:
    """`on_storage` for a command on the index alone (tokens): the blob store is neither
    opened nor created."""
    return on_storage(command, with_blobs=False)
