"""check_drift.py's shared part: paths and service names, the pass/fail
record (`check`), rendering and loading the overlays, and reading compose
services and Kubernetes objects alike (mounts, probes, environment)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml


K8S = Path(__file__).resolve().parent
REPO = K8S.parent

COORD_SVC = "pagewire-coordinator"
NODE_SVCS = ("node-1", "node-2", "node-3")
TOOLS_SVC = "tools"

failures: list[str] = []
passes = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    global passes
    if ok:
        passes += 1
        print(f"  OK    {name}")
    else:
        failures.append(name)
        print(f"  FAIL  {name}" + (f": {detail}" if detail else ""))


# --- inputs -----------------------------------------------------------------


RDMA_OVERLAYS = ("soft-roce", "roce")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        sys.exit(f"check_drift: kubectl not found (needed to render k8s/overlays/{overlay})")
    with tempfile.TemporaryDirectory(prefix="pagewire-drift-") as tmp:
        t = Path(tmp)
        for d in ("base", "overlays", "components"):
            shutil.copytree(K8S / d, t / d)
        (t / "base" / "cluster-token").write_text(os.urandom(16).hex())
        # ha-external's etcd TLS files: git-ignored, without placeholders;
        # kustomize only copies their bytes into a Secret.
        tls = t / "components" / "ha" / "external" / "tls"
        for f in ("ca.crt", "client.crt", "client.key"):
            if tls.is_dir() and not (tls / f).exists():
                (tls / f).write_text(f"throwaway {f} for check_drift.py\n")
        out = subprocess.run(
            [kubectl, "kustomize", str(t / "overlays" / overlay)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def load_rendered(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(v):
    """Compose variable substitution with the defaults (the environment is
    ignored, so the check is deterministic); `$$` is a literal `$`."""
    if isinstance(v, str):
        return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else (m.group(2) or ""), v)
    if isinstance(v, list):
        return [interpolate(x) for x in v]
    if isinstance(v, dict):
        return {k: interpolate(x) for k, x in v.items()}
    return v


def argv(v) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return shlex.split(v)
    return [str(x) for x in v]


def dockerfile_runtime() -> dict:
    """ENTRYPOINT, CMD, USER and EXPOSE of the Dockerfile's last stage."""
    info = {"entrypoint": None, "cmd": None, "user": None, "expose": set()}
    path = REPO / "Dockerfile"
    if not path.exists():
        return info
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        rest = rest.strip()
        if word == "FROM":
            info = {"entrypoint": None, "cmd": None, "user": None, "expose": set()}
        elif word in ("ENTRYPOINT", "CMD"):
            try:
                val = json.loads(rest)
            except json.JSONDecodeError:
                val = ["/bin/sh", "-c", rest]
            info[word.lower()] = [str(x) for x in val]
        elif word == "USER":
            info["user"] = rest.split(":")[0]
        elif word == "EXPOSE":
            info["expose"] |= {int(p.split("/")[0]) for p in rest.split()}
    return info


def effective(entrypoint, command, image) -> list[str]:
    """The process's argv: Docker and Kubernetes combine them the same way
    (an explicit entrypoint/command drops the image's CMD)."""
    if entrypoint is not None:
        return entrypoint + (command or [])
    return (image["entrypoint"] or []) + (
        command if command is not None else (image["cmd"] or [])
    )


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def mib(size: str) -> float:
    """A size (Kubernetes quantity or a tmpfs size= option) in MiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]i?|[kmg]|)", str(size).strip())
    if not m:
        raise ValueError(f"cannot read size {size!r}")
    n, unit = float(m.group(1)), m.group(2)
    factor = {
        "": 1 / 2**20,
        "k": 1 / 1024, "K": 1 / 1024, "Ki": 1 / 1024,
        "m": 1, "M": 1, "Mi": 1,
        "g": 1024, "G": 1024, "Gi": 1024,
    }[unit]
    # Kubernetes' k/M/G are powers of 1000; tmpfs' k/m/g are powers of 1024.
    return n * factor


def seconds(v) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(v))
    if not m or not any(m.groups()):
        raise ValueError(f"cannot read duration {v!r}")
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0)


# --- compose ------------------------------------------------------------------


def compose_mounts(svc: dict, volumes_top: dict) -> dict[str, dict]:
    """target -> {"kind": bind|volume|tmpfs, "source": ..., "size": ...}."""
    out: dict[str, dict] = {}
    for v in svc.get("volumes", []) or []:
        if isinstance(v, str):
            parts = v.split(":")
            src, tgt = parts[0], parts[1]
            kind = "bind" if src.startswith((".", "/")) else "volume"
            out[tgt] = {"kind": kind, "source": src}
        else:
            out[v["target"]] = {"kind": v.get("type", "volume"), "source": v.get("source")}
    tmpfs = svc.get("tmpfs") or []
    if isinstance(tmpfs, str):
        tmpfs = [tmpfs]
    for t in tmpfs:
        path, _, opts = t.partition(":")
        o = dict(x.partition("=")[::2] for x in opts.split(",") if x)
        out[path] = {"kind": "tmpfs", "source": None, "size": o.get("size")}
    return out


def compose_probe(svc: dict) -> tuple[str, int] | None:
    hc = svc.get("healthcheck") or {}
    test = hc.get("test")
    if not test:
        return None
    text = " ".join(test) if isinstance(test, list) else str(test)
    port = re.search(r"/dev/tcp/[^/\s]+/(\d+)", text) or re.search(
        r"https?://[^/\s:]+:(\d+)", text
    )
    path = re.search(r"GET (/\S*) HTTP", text) or re.search(
        r"https?://[^/\s]+(/[^\s'\"]*)", text
    )
    if not (port and path):
        return None
    return path.group(1), int(port.group(1))


def compose_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.partition("=")[::2] for e in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


# --- k8s ----------------------------------------------------------------------


def find(objs, kind, name, overlay="tcp") -> dict:
    for o in objs:
        if o.get("kind") == kind and o["metadata"]["name"] == name:
            return o
    sys.exit(f"check_drift: no {kind} {name} in the rendered {overlay} overlay")


def container(obj, name) -> dict:
    for c in obj["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    sys.exit(f"check_drift: no container {name} in {obj['kind']} {obj['metadata']['name']}")


def k8s_mounts(obj, c) -> dict[str, dict]:
    vols = {v["name"]: v for v in obj["spec"]["template"]["spec"].get("volumes", [])}
    for t in obj["spec"].get("volumeClaimTemplates", []) or []:
        vols[t["metadata"]["name"]] = {"name": t["metadata"]["name"], "pvc": t}
    out = {}
    for m in c.get("volumeMounts", []):
        v = vols.get(m["name"], {})
        kind = next((k for k in v if k != "name"), "?")
        out[m["mountPath"]] = {
            "kind": kind,
            "subPath": m.get("subPath"),
            "volume": v,
            "readOnly": bool(m.get("readOnly")),
        }
    return out


def k8s_probe(c, which) -> tuple[str, int] | None:
    p = (c.get(which) or {}).get("httpGet")
    if not p:
        return None
    port = p["port"]
    if isinstance(port, str):
        port = next(x["containerPort"] for x in c["ports"] if x.get("name") == port)
    return p["path"], int(port)


def prestop_wait(c) -> float:
    """Seconds the preStop hook may take: pwctl drain --wait N, else 0."""
    cmd = " ".join(((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", []))
    m = re.search(r"--wait[ =](\d+)", cmd)
    return float(m.group(1)) if m else 0.0


def config_map(objs) -> dict | None:
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pagewire-config")]
    return cms[0] if len(cms) == 1 else None
