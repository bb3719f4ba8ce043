"""The layers link and include only downward, and the server builds without client/.

scripts/layers reads the link graph from the CMakeLists.txt files and checks
every #include against it, and every core function a transport names against
docs/DESIGN.md's table of direct calls; these tests run it on the tree, show
that it catches a wrong-way include, a client header in the server, a link
cycle, a transport calling the core around the service and a stale row of
that table, and build zshard-server from a copy of the tree that has no
client/ folder. DESIGN.md's statements about what the CLI uses are checked
against its includes.
"""
import os
import re
import shutil
import subprocess

SRC = os.environ.get("ZS_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
LAYERS = os.path.join(SRC, "scripts", "layers")
TREE = ("CMakeLists.txt", "proto", "include", "common", "server", "client")


def copy_tree(dst, without=()):
    for name in TREE:
        if name in without:
            continue
        src = os.path.join(SRC, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name))
        else:
            shutil.copy(src, dst)
    # tests/fuzz is added by the top-level CMakeLists.txt whatever is built.
    shutil.copytree(os.path.join(SRC, "tests", "fuzz"), os.path.join(dst, "tests", "fuzz"))
    # DESIGN.md's table of the core functions a transport may call.
    os.makedirs(os.path.join(dst, "docs"), exist_ok=True)
    shutil.copy(os.path.join(SRC, "docs", "DESIGN.md"), os.path.join(dst, "docs"))


def run_layers(root):
    return subprocess.run([LAYERS, str(root)], capture_output=True, text=True, timeout=60)


def prepend(path, line):
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(line + "\n" + text)


def test_the_tree_links_and_includes_only_downward():
    r = run_layers(SRC)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("layers: ok")


def test_an_include_from_a_higher_layer_is_reported(tmp_path):
    copy_tree(tmp_path)
    prepend(tmp_path / "common" / "base" / "log.c", '#include "server/core/core.h"')
    prepend(tmp_path / "server" / "core" / "core.c", '#include "server/transport/dp/dp_server.h"')
    r = run_layers(tmp_path)
    assert r.returncode == 1
    assert 'common/base/log.c:1: includes "server/core/core.h" of zs_core, which zs_base does not link' in r.stdout
    assert "server/core/core.c:1: includes \"server/transport/dp/dp_server.h\" of zs_transport_dp" in r.stdout
    assert "2 violation(s)" in r.stdout


def test_the_server_may_not_include_the_client_public_header(tmp_path):
    copy_tree(tmp_path)
    prepend(tmp_path / "server" / "core" / "pool.c", '#include "zshard/zshard.h"')
    r = run_layers(tmp_path)
    assert r.returncode == 1
    assert "server/core/pool.c:1: includes include/zshard/zshard.h" in r.stdout


def test_a_link_cycle_is_reported(tmp_path):
    copy_tree(tmp_path)
    with open(tmp_path / "server" / "optim" / "CMakeLists.txt", "a") as f:
        f.write("target_link_libraries(zs_optim PUBLIC zs_core)\n")
    r = run_layers(tmp_path)
    assert r.returncode == 1
    assert "link cycle:" in r.stdout and "zs_core" in r.stdout and "zs_optim" in r.stdout


def replace_in(path, old, new):
    with open(path) as f:
        text = f.read()
    assert old in text, f"{old!r} not in {path}"
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def test_a_transport_calling_the_core_directly_is_reported(tmp_path):
    copy_tree(tmp_path)
    # GetInfo's reader, sent back around the service: a call the table does
    # not list for the gRPC transport.
    replace_in(tmp_path / "server" / "transport" / "grpc" / "grpc_job.c",
               "service_counters(s->svc, &k)", "core_get_counters(s->core, &k)")
    # A call named only in a comment or a string is not a call.
    prepend(tmp_path / "server" / "transport" / "dp" / "dp_server.c",
            '/* core_push(c, ...) */ static const char *zs_note_ = "core_apply(";')
    r = run_layers(tmp_path)
    assert r.returncode == 1, r.stdout
    lines = [l for l in r.stdout.splitlines() if "violation" not in l]
    assert len(lines) == 1, r.stdout
    assert "server/transport/grpc/grpc_job.c:" in lines[0]
    assert "calls core_get_counters, which docs/DESIGN.md" in lines[0]
    assert "does not list for transport/grpc" in lines[0]


def test_the_table_of_direct_calls_may_not_go_stale(tmp_path):
    copy_tree(tmp_path)
    design = tmp_path / "docs" / "DESIGN.md"
    # A row for a call no transport makes, and a function the core lacks.
    replace_in(design, "| `core_missing` | grpc |", "| `core_missing` | grpc, dp |")
    replace_in(design, "| `core_low_dtype` | dp |", "| `core_low_dtype`, `core_teleport` | dp |")
    r = run_layers(tmp_path)
    assert r.returncode == 1, r.stdout
    assert "docs/DESIGN.md: lists core_missing for transport/dp, which does not call it" in r.stdout
    assert "docs/DESIGN.md: lists core_teleport, which server/core/core.h does not declare" in r.stdout
    assert "2 violation(s)" in r.stdout


def test_the_server_builds_without_the_client_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    copy_tree(src, without=("client",))
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True, timeout=300)
    r = subprocess.run(["cmake", "--build", str(build), "--target", "zshard-server", "-j",
                        str(os.cpu_count() or 2)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    server = build / "server" / "zshard-server"
    v = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    assert v.returncode == 0, v.stderr
    assert "0." in v.stdout + v.stderr


def includes_of(folder):
    found = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith((".c", ".h")):
            with open(os.path.join(folder, fn), encoding="utf-8") as f:
                for line in f:
                    m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if m:
                        found.setdefault(m.group(1), []).append(fn)
    return found


def test_the_cli_uses_what_design_md_says():
    """DESIGN.md: the CLI uses the public headers, two internal headers of the
    library (cli_support.h, ckpt_client.h), common/, the generated protobuf-c
    messages and the server's checkpoint library; and `zshard estimate` takes
    the optimizer's bytes as an input rather than asking optim_state_needs()."""
    cli = os.path.join(SRC, "client", "cli")
    local = {fn for fn in os.listdir(cli) if fn.endswith(".h")}
    allowed = re.compile(r"^(zshard/(zshard|types)\.h|cli_support\.h|ckpt_client\.h|common/[a-z]+/\w+\.h|"
                         r"(zshard/v1|grpc/health/v1)/\w+\.pb-c\.h|server/ckpt/ckpt\.h)$")
    other = {inc: who for inc, who in includes_of(cli).items() if inc not in local and not allowed.match(inc)}
    assert not other, other
    with open(os.path.join(SRC, "docs", "DESIGN.md"), encoding="utf-8") as f:
        design = f.read()
    for name in ("cli_support.h", "ckpt_client.h", "`zs_proto`", "`zs_ckpt`"):
        assert name in design, name
    for path in (("client", "lib", "estimate.c"), ("client", "cli", "estimate.c")):
        with open(os.path.join(SRC, *path), encoding="utf-8") as f:
            assert "optim_state_needs" not in f.read(), path
