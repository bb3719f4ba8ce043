"""docs/SECURITY.md says what the code does, where that can be checked by reading both.

- Its roles table is the role column of the gRPC transport's method table, method for method.
- Every test it names as the proof of a claim exists and is run: a pytest
  function, or a cmocka test registered in its program's list.
- The sections it took over are not pointed to in their old place.
"""
import os
import re

SRC = os.environ.get("ZS_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DOC = os.path.join(SRC, "docs", "SECURITY.md")
GRPC = os.path.join(SRC, "server", "transport", "grpc", "grpc_methods.c")
ROLE_NAMES = {"AUTH_NONE": "none", "AUTH_TRAINER": "trainer", "AUTH_ADMIN": "admin"}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def server_roles():
    """{method name as in the doc: role} from grpc_methods.c's table."""
    text = read(GRPC)
    table = re.search(r"gsrv__methods\[[^\]]*\]\s*=\s*\{(.*?)\n\};", text, re.S)
    assert table, "gsrv__methods not found in grpc_methods.c"
    roles = {}
    for m, row in re.findall(r"\[(M_\w+)\]\s*=\s*\{(.*?)\}", table.group(1), re.S):
        role = re.search(r"\b(AUTH_\w+)\b", row)
        assert role, f"{m} has no role"
        if m == "M_GENERIC":  # no path: any method the server does not know
            continue
        path = re.search(r'"/([\w.]+/\w+)"', row)
        assert path, f"{m} has a role but no path"
        path = path.group(1)
        name = path.split("/")[1] if path.startswith("zshard.v1.ZShard/") else path
        roles[name] = ROLE_NAMES[role.group(1)]
    return roles


def doc_roles():
    text = read(DOC)
    section = text.split("## Roles: who may call what", 1)[1].split("\n## ", 1)[0]
    roles = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([\w./]+)`\s*\|\s*(none|trainer|admin)\s*\|", line)
        if m:
            assert m.group(1) not in roles, f"{m.group(1)} twice in the roles table"
            roles[m.group(1)] = m.group(2)
    return roles


def test_the_roles_table_is_the_servers():
    server, doc = server_roles(), doc_roles()
    assert len(server) >= 20, server
    assert doc == server, {k: (doc.get(k), server.get(k)) for k in set(doc) | set(server)
                           if doc.get(k) != server.get(k)}


def find_test_file(name):
    for sub in ("python", "unit", "integration"):
        p = os.path.join(SRC, "tests", sub, name)
        if os.path.isfile(p):
            return p
    return None


def test_every_test_named_as_a_proof_exists_and_runs():
    refs = re.findall(r"`(test_\w+\.(?:py|c))::(\w+)`", read(DOC))
    assert len(refs) >= 80, len(refs)
    missing = []
    for fname, test in refs:
        path = find_test_file(fname)
        if path is None:
            missing.append(f"{fname}: no such file under tests/")
            continue
        text = read(path)
        if fname.endswith(".py"):
            ok = re.search(r"^\s*def " + re.escape(test) + r"\(", text, re.M)
        else:
            ok = re.search(r"cmocka_unit_test\w*\(\s*" + re.escape(test) + r"\b", text)
        if not ok:
            missing.append(f"{fname}::{test}: not a test that runs")
    assert not missing, "\n".join(missing)


def test_the_moved_sections_are_not_pointed_to_in_their_old_place():
    old = re.compile(r'OPERATIONS\.md[,"\s(]*"(Security|Rank tokens|Rotating tokens|TLS|Threat model|'
                     r'Roles|What is not protected|Guarantees against hostile clients|/metrics)"')
    stale = []
    for top in ("docs", "server", "common", "client", "tests", "README.md"):
        base = os.path.join(SRC, top)
        walk = [(SRC, [], [top])] if os.path.isfile(base) else os.walk(base)
        for d, _, files in walk:
            for fn in files:
                if not fn.endswith((".md", ".c", ".h", ".py")):
                    continue
                p = os.path.join(d, fn)
                for n, line in enumerate(read(p).splitlines(), 1):
                    if old.search(line):
                        stale.append(f"{os.path.relpath(p, SRC)}:{n}: {line.strip()}")
    assert not stale, "\n".join(stale)
