"""The benchmarks' shared helpers (benchmarks/harness/benchlib.py) and the server benchmark's wire
framing: pure functions and real processes, no timing."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness.benchlib import (
    MiB,
    machine_info,
    markdown_table,
    median,
    median_of_present,
    parse_list,
    parse_size,
    percentile,
    ratio,
    text_table,
    wait_port,
    write_json,
)
from benchmarks.harness.servers import free_port
from benchmarks.serverbench.wire import ProtocolError, parse_head


def test_sizes_parse_with_binary_units_and_refuse_the_rest():
    assert parse_size("64MiB") == 64 * MiB
    assert parse_size(" 512 KiB ") == 512 * 1024
    assert parse_size("1GiB") == 1024 * MiB
    assert parse_size("123") == parse_size("123B") == 123
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("64MB")  # decimal units are ambiguous: refused, not guessed
    sizes = parse_list(parse_size)
    assert sizes("1MiB,64MiB,") == [MiB, 64 * MiB]
    for bad in ("", "0", "4,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive"):
            parse_list(int)(bad)


def test_medians_percentiles_and_ratios():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([]) == 0.0
    assert median_of_present([None, 4, 2, None]) == 3.0
    assert median_of_present([None]) is None
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile([], 0.99) == 0.0
    assert ratio(1.0, 3.0) == 0.333
    assert ratio(1.0, 0.0) is None


def test_tables_keep_their_columns():
    md = markdown_table(["a", "b"], [["x|y", "2"]])
    assert md.splitlines() == ["| a | b |", "|---|---|", "| x/y | 2 |"]
    text = text_table(["name", "n"], [["long name", "1"], ["x", "22"]]).splitlines()
    assert text[1] == "---------  --"
    assert [line.index(cell) for line, cell in zip(text[2:], ("1", "22"), strict=True)] \
        == [11, 11]


def test_write_json_creates_the_directory(tmp_path: Path):
    out = tmp_path / "a" / "b.json"
    write_json(out, {"x": [1, 2]})
    assert out.read_text().endswith("\n")
    assert json.loads(out.read_text()) == {"x": [1, 2]}


def test_machine_info_reports_missing_tools_and_packages_as_none():
    info = machine_info(packages={"pytest": "pytest", "nope": "no-such-dist-xyz"},
                        tools={"py": [sys.executable, "--version"],
                               "gone": ["no-such-tool-xyz"]})
    assert info["cores"] and info["python"] and info["pytest"] == pytest.__version__
    assert info["py"].startswith("Python 3")
    assert info["nope"] is None and info["gone"] is None
    assert list(info)[-1] == "git_commit"


def test_wait_port_returns_once_listening_and_fails_when_the_process_dies():
    port = free_port()
    listener = subprocess.Popen([sys.executable, "-c", (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)")])
    try:
        wait_port(port, listener, "listener", timeout=30)
        socket.create_connection(("127.0.0.1", port), 5).close()
    finally:
        listener.kill()
        listener.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="dead exited with 3"):
        wait_port(free_port(), dead, "dead", timeout=30)


def test_parse_head_frames_http_and_resp():
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX: y\r\n\r\nhel"
    assert parse_head("http", head[:20], 200) is None  # incomplete: read more
    assert parse_head("http", head, 200) == (len(head) - 3, 5, True)
    assert parse_head("http", head, 201)[2] is False  # type: ignore[index]
    with pytest.raises(ProtocolError, match="no Content-Length"):
        parse_head("http", b"HTTP/1.1 200 OK\r\nX: y\r\n\r\n", 200)
    assert parse_head("resp", b"$10\r\n0123", 200) == (5, 12, True)  # value + CRLF
    assert parse_head("resp", b"$10", 200) is None
    with pytest.raises(ProtocolError, match="not a bulk string"):
        parse_head("resp", b"-ERR nope\r\n", 200)


def test_the_gxx_counter_is_invisible_to_the_compiler_it_counts(tmp_path: Path):
    """Torch keys its ISA probe libraries by `g++ -v`, which names how the driver was run:
    a counted process must see what an uncounted one sees, or a counted restart rebuilds
    the probes an uncounted cold start published (and the count is of our making)."""
    from benchmarks.harness.machines import GxxCounter, clean_env

    counter = GxxCounter(tmp_path / "bin dir")
    log = tmp_path / "gxx.log"
    plain = subprocess.run(["g++", "-v"], capture_output=True, text=True, env=clean_env())
    counted = subprocess.run(["g++", "-v"], capture_output=True, text=True,
                             env=clean_env() | counter.env(log))
    assert counted.returncode == plain.returncode == 0
    assert counted.stderr == plain.stderr
    source = tmp_path / "probe.cpp"
    source.write_text("extern \"C\" int probe() { return 1; }\n")
    built = subprocess.run(["g++", "-shared", "-fPIC", "-o", str(tmp_path / "probe.so"),
                            str(source)], env=clean_env() | counter.env(log))
    assert built.returncode == 0 and (tmp_path / "probe.so").is_file()
    assert GxxCounter.builds(log) == 1


@pytest.mark.e2e
def test_a_new_machine_takes_the_built_toolchain_and_a_used_one_keeps_its_own(
        toolchain: Path, tmp_path: Path):
    """The toolchain holds torch's precompiled header and its ISA probe libraries, and
    nothing of the compile that built the header (its kernel would ship in a producer's
    kernels pack as if the producer had compiled it). A new machine takes a copy; a machine
    whose jobs have run keeps what they left (a stopped job's half-built files included)."""
    from benchmarks.harness.machines import Machine

    (header,) = (toolchain / "tmp").rglob("*.h.gch")
    probes = sorted((toolchain / "inductor").rglob("*.cpp"))
    assert probes and all((p.with_suffix(".so")).is_file() for p in probes), probes
    kernels = [p for p in probes if "cpp_prefix.h" in p.read_text()]
    assert not kernels, kernels
    node = Machine(tmp_path / "node", toolchain)
    copied = node.root / "tmp" / header.relative_to(toolchain / "tmp")
    assert copied.read_bytes() == header.read_bytes()
    assert len(list((node.root / "inductor").rglob("*.so"))) == len(probes)
    copied.write_bytes(b"what a job left")
    Machine(tmp_path / "node", toolchain)
    assert copied.read_bytes() == b"what a job left"


def test_a_new_seaweedfs_whose_port_was_taken_meanwhile_starts_on_new_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Ports picked free can be taken before weed binds them (another process's outgoing
    connection took one in a CI run): a first start tries new ports."""
    from conftest import started

    from benchmarks.harness import servers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        real = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or real())
        weed = started(servers.LocalSeaweedS3(tmp_path / "s3"), "SeaweedFS (weed)")
        try:
            said = (tmp_path / "s3" / "weed.log").read_text()
            assert any(taken in said for taken in servers.PORT_TAKEN), said
            assert weed._ready()
        finally:
            weed.stop()


def test_a_stopped_seaweedfs_leaves_no_socket_in_tmp(tmp_path: Path):
    """weed makes a unix socket per listener in /tmp (its gRPC ones at a fixed path, not
    TMPDIR) and leaves some at exit: a passing suite must leave nothing there."""
    from conftest import started

    from benchmarks.harness import servers

    weed = started(servers.LocalSeaweedS3(tmp_path / "s3"), "SeaweedFS (weed)")
    try:
        up = time.monotonic() + 10  # its admin and S3 gRPC listeners come after S3's HTTP
        while not all(s.exists() for s in weed.grpc_sockets) and time.monotonic() < up:
            time.sleep(0.1)
        assert any(s.exists() for s in weed.grpc_sockets), weed.grpc_sockets  # weed's names
    finally:
        weed.stop()
    ports = {str(port) for _, port in weed.grpc_ports} | {str(weed.port), str(weed.filer_port)}
    left = [s for s in Path("/tmp").glob("seaweedfs-*.sock") if s.stem.rsplit("-", 1)[1] in ports]
    assert left == []
