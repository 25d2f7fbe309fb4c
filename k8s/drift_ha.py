"""check_drift.py's HA part: the ha overlay against the compose HA cluster,
ha-external against ha."""

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


from drift_lib import *  # noqa: F403 (the checks share every helper)

# --- ha: the ha overlay against the compose HA cluster, ha-external against ha --

HA_OVERLAYS = ("ha", "ha-external")
HA_CONFIG = K8S / "components" / "ha" / "coordinator.toml"
HA_EXTERNAL_CONFIG = K8S / "components" / "ha" / "external" / "coordinator.toml"
ETCD_IMAGE_SCRIPT = K8S / "image" / "etcd.sh"
ETCD_ENTRYPOINT = K8S / "image" / "etcd-entrypoint.sh"
# What the HA coordinator.toml may change in the base's: the store (etcd),
# the advertised name (each coordinator's own, from --advertise), the file
# store's state file (unused) and the [etcd] section.
# lease_ms too: the node lease must outlast a leader failover (the etcd
# lease) plus a heartbeat interval (k8s/components/ha/coordinator.toml).
HA_TOML_KEYS = {"store", "advertise", "state_file", "lease_ms", "etcd"}
# What ha-external's coordinator.toml may change in ha's: the endpoints and
# the [etcd] keys of TLS and etcd's own user.
HA_EXTERNAL_ETCD_KEYS = {"ca_file", "cert_file", "key_file", "domain", "username", "password_file"}


def env_map(v) -> dict[str, str]:
    """A compose `environment` (mapping or list) as a mapping."""
    if isinstance(v, list):
        v = dict(e.partition("=")[::2] for e in v)
    return {k: ("" if x is None else str(x)) for k, x in (v or {}).items()}


def merge_service(b: dict, o: dict) -> dict:
    """Compose's merge of an override file's service into the base's (the
    rules `docker-compose -f a -f b config` applies to the keys used here):
    environment merged by name, volumes by target, ports and expose
    appended, other mappings (depends_on, networks, healthcheck) merged one
    level deep, everything else (command, image, ...) replaced."""
    out = dict(b)
    for k, v in o.items():
        if k == "environment":
            out[k] = {**env_map(b.get(k)), **env_map(v)}
        elif k == "volumes":
            def tgt(x):
                return x.split(":")[1] if isinstance(x, str) else x["target"]
            by = {tgt(x): x for x in b.get(k) or []}
            by.update({tgt(x): x for x in v or []})
            out[k] = list(by.values())
        elif k in ("ports", "expose"):
            out[k] = list(b.get(k) or []) + list(v or [])
        elif isinstance(v, dict) and isinstance(b.get(k), dict):
            out[k] = {**b[k], **v}
        else:
            out[k] = v
    return out


def compose_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k == "services":
            svcs = dict(base.get("services") or {})
            for name, s in (v or {}).items():
                svcs[name] = merge_service(svcs.get(name) or {}, s or {})
            out[k] = svcs
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def toml_diff(a: dict, b: dict) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def check_base_but_ha_keys(rel: Path, base_toml: dict, toml: dict) -> None:
    """An HA coordinator file is the base's but for the HA keys."""
    diff = toml_diff(base_toml, toml)
    check(
        f"{rel} is k8s/base/config/coordinator.toml but for {', '.join(sorted(HA_TOML_KEYS))}",
        diff <= HA_TOML_KEYS,
        f"also differs in {sorted(diff - HA_TOML_KEYS)} (copy the base's change over)",
    )


def etcd_image_build() -> dict:
    """The default tag, ENTRYPOINT, USER and EXPOSE of the Dockerfile that
    k8s/image/etcd.sh writes, and the ports the entrypoint listens on."""
    info = {"tag": None, "entrypoint": None, "user": None, "expose": set(), "client": None, "peer": None, "data": None}
    if ETCD_IMAGE_SCRIPT.exists():
        t = ETCD_IMAGE_SCRIPT.read_text()
        m = re.search(r"(?m)^tag=(\S+)", t)
        info["tag"] = m.group(1) if m else None
        m = re.search(r'(?m)^ENTRYPOINT (\[.*\])$', t)
        info["entrypoint"] = json.loads(m.group(1)) if m else None
        m = re.search(r"(?m)^USER (\d+)", t)
        info["user"] = int(m.group(1)) if m else None
        m = re.search(r"(?m)^EXPOSE ([\d ]+)$", t)
        info["expose"] = {int(p) for p in m.group(1).split()} if m else set()
    if ETCD_ENTRYPOINT.exists():
        e = ETCD_ENTRYPOINT.read_text()
        for key, flag in (("client", "listen-client-urls"), ("peer", "listen-peer-urls")):
            m = re.search(rf"--{flag} http://0\.0\.0\.0:(\d+)", e)
            info[key] = int(m.group(1)) if m else None
        m = re.search(r"--data-dir (\S+)", e)
        info["data"] = m.group(1) if m else None
    return info


def pod_labels(obj) -> dict:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def anti_affinity_per_host(obj) -> bool:
    """Required pod anti-affinity on kubernetes.io/hostname against the
    object's own pods: at most one per host."""
    terms = (
        ((obj["spec"]["template"]["spec"].get("affinity") or {}).get("podAntiAffinity") or {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
        or []
    )
    return any(
        t.get("topologyKey") == "kubernetes.io/hostname"
        and selects((t.get("labelSelector") or {}).get("matchLabels", {}), pod_labels(obj))
        for t in terms
    )


def pdb_for(objs, obj, overlay) -> dict | None:
    for o in objs:
        if o["kind"] == "PodDisruptionBudget" and selects(o["spec"]["selector"].get("matchLabels", {}), pod_labels(obj)):
            return o
    return None


def env_value(c, name) -> str | None:
    return next((e.get("value") for e in c.get("env", []) if e["name"] == name), None)


def check_ha(
    tcp_objs, ha_objs, hax_objs, compose_path: Path, compose_ha_path: Path, base_coord_text: str, image: dict
) -> None:
    print(f"ha: k8s/overlays/ha against the compose HA cluster ({compose_path.name} with {compose_ha_path.name}):")
    compose = interpolate(
        compose_merge(yaml.safe_load(compose_path.read_text()), yaml.safe_load(compose_ha_path.read_text()))
    )
    services = compose.get("services", {})
    base_toml = tomllib.loads(base_coord_text)
    ha_text = HA_CONFIG.read_text()
    ha_toml = tomllib.loads(ha_text)
    grpc = port_of(ha_toml["listen"])
    http = port_of(ha_toml["metrics_listen"])

    # -- the config file, shared by compose and k8s
    rel = HA_CONFIG.relative_to(REPO)
    check_base_but_ha_keys(rel, base_toml, ha_toml)
    check(
        f"{rel}: advertise is empty (each coordinator's own name comes from --advertise)",
        ha_toml.get("advertise") == "",
        f"advertise = {ha_toml.get('advertise')!r}",
    )

    # -- the coordinators
    coords = {
        n: s
        for n, s in services.items()
        if (effective(argv(s.get("entrypoint")), argv(s.get("command")), image) or [""])[0] == "pagewire-coordinator"
    }
    sts = find(ha_objs, "StatefulSet", "pagewire-coordinator", "ha")
    kc = container(sts, "coordinator")
    replicas = sts["spec"].get("replicas", 1)
    check("compose HA runs 3 coordinators", len(coords) == 3, f"compose: {sorted(coords)}")
    check("k8s ha: StatefulSet pagewire-coordinator has 3 replicas", replicas == 3, f"replicas {replicas}")
    want_argv = ["pagewire-coordinator", "--config", "/etc/pagewire/coordinator.toml", "--advertise"]
    headless = sts["spec"]["serviceName"]
    advertised = []
    for n, s in sorted(coords.items()):
        dc = effective(argv(s.get("entrypoint")), argv(s.get("command")), image)
        want = f"{s.get('hostname') or n}:{grpc}"
        check(
            f"compose {n}: {' '.join(want_argv)} {want} (its own name, the listen port)",
            dc == want_argv + [want] and (s.get("hostname") in (None, n)),
            f"compose {dc}, hostname {s.get('hostname')!r}",
        )
        advertised.append(dc[-1] if dc else "")
    kargv = effective(argv(kc.get("command")), argv(kc.get("args")), image)
    kwant = f"$(POD_NAME).{headless}:{grpc}"
    check(
        f"k8s coordinator: {' '.join(want_argv)} {kwant} (compose's command line but for each one's name)",
        kargv == want_argv + [kwant],
        f"k8s {kargv}",
    )
    pod_name = next((e for e in kc.get("env", []) if e["name"] == "POD_NAME"), {})
    check(
        "k8s coordinator: POD_NAME from metadata.name",
        pod_name.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
    )
    svc = find(ha_objs, "Service", headless, "ha")
    check(
        f"k8s Service {headless} is headless, selects the coordinator pods, ports grpc {grpc} and http {http}",
        svc["spec"].get("clusterIP") == "None"
        and selects(svc["spec"]["selector"], pod_labels(sts))
        and {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": grpc, "http": http},
    )
    cm = config_map(ha_objs)
    # The reference: a coordinator that only ha.yml defines. The first one
    # is docker-compose.yml's single coordinator with ha.yml merged over it,
    # so it keeps that file's state volume (an override cannot remove a
    # mount; the etcd store never writes there): allowed, nothing else.
    single = yaml.safe_load(compose_path.read_text()).get("services", {})
    added = sorted(n for n in coords if n not in single)
    first = coords[added[0]] if added else {}
    state_dir = str(Path(base_toml["state_file"]).parent)

    def shape(s, leftover):
        out = {k: v for k, v in s.items() if k not in ("command", "hostname", "networks")}
        vols = [v for v in out.get("volumes") or [] if not (leftover and (v.split(":")[1] if isinstance(v, str) else v["target"]) == state_dir)]
        return {**out, "volumes": vols}

    for n, s in sorted(coords.items()):
        if s is first:
            continue
        leftover = n in single
        check(
            f"compose {n} is defined as {added[0] if added else '?'} (but for its name and addresses"
            + (f"; the single cluster's {state_dir} volume, unused with etcd" if leftover else "")
            + ")",
            shape(s, leftover) == shape(first, False),
            f"{sorted(k for k in set(s) | set(first) if shape(s, leftover).get(k) != shape(first, False).get(k))} differ",
        )
        src = compose_mounts(s, {}).get("/etc/pagewire/coordinator.toml", {})
        path = (compose_ha_path.parent / str(src.get("source"))).resolve() if src.get("kind") == "bind" else None
        check(f"compose {n} mounts {rel} at /etc/pagewire/coordinator.toml", path == HA_CONFIG.resolve(), f"{src}")
    km = k8s_mounts(sts, kc)
    m = km.get("/etc/pagewire/coordinator.toml", {})
    check(
        "k8s coordinator mounts the ConfigMap key coordinator.toml at /etc/pagewire/coordinator.toml",
        cm is not None and m.get("kind") == "configMap" and m.get("subPath") == "coordinator.toml"
        and m["volume"]["configMap"]["name"] == cm["metadata"]["name"],
    )
    check(
        f"ha: the ConfigMap's coordinator.toml is {rel} byte for byte",
        cm is not None and cm["data"].get("coordinator.toml") == ha_text,
    )
    check(
        "ha: the ConfigMap's node.toml is the base's byte for byte (the nodes' coordinators come from PAGEWIRE_COORDINATOR)",
        cm is not None and cm["data"].get("node.toml") == (K8S / "base" / "config" / "node.toml").read_text(),
    )
    dm = compose_mounts(first, {})
    check(
        "coordinator mount paths equal (config, token; no state: it is in etcd)",
        set(dm) == set(km),
        f"compose {sorted(dm)} vs k8s {sorted(km)}",
    )
    check("k8s ha: no PVC for the coordinators", not sts["spec"].get("volumeClaimTemplates"))
    de = set(env_map(first.get("environment")))
    ke = {e["name"] for e in kc.get("env", [])} - {"POD_NAME"}
    check("coordinator env names equal (k8s adds POD_NAME for --advertise)", de == ke, f"compose {sorted(de)} vs k8s {sorted(ke)}")
    dpr, kr = compose_probe(first), k8s_probe(kc, "readinessProbe")
    check(
        f"coordinator: compose healthcheck = k8s readinessProbe = /readyz on {http}",
        dpr == kr == ("/readyz", http),
        f"compose {dpr} vs k8s {kr}",
    )
    check("coordinator: same image", first.get("image") == kc.get("image"), f"compose {first.get('image')} vs k8s {kc.get('image')}")
    check("k8s coordinators: at most one per host (required anti-affinity on kubernetes.io/hostname)", anti_affinity_per_host(sts))
    pdb = pdb_for(ha_objs, sts, "ha")
    check(
        "k8s ha: the coordinators' PDB keeps 2 of 3 (minAvailable 2)",
        pdb is not None and pdb["spec"].get("minAvailable") == 2 and "maxUnavailable" not in pdb["spec"],
        f"{pdb and pdb['spec']}",
    )

    # -- the clients: all three coordinators
    k8s_list = ",".join(f"{sts['metadata']['name']}-{i}.{headless}:{grpc}" for i in range(replicas))
    compose_list = ",".join(advertised)
    for n in (*NODE_SVCS, TOOLS_SVC):
        got = env_map(services.get(n, {}).get("environment")).get("PAGEWIRE_COORDINATOR", "")
        check(
            f"compose {n}: PAGEWIRE_COORDINATOR names every coordinator as it advertises itself",
            sorted(got.split(",")) == sorted(advertised),
            f"{got!r} vs the coordinators' {compose_list!r}",
        )
    ds = find(ha_objs, "DaemonSet", "pagewire-node", "ha")
    node = container(ds, "node")
    admin = container(find(ha_objs, "Deployment", "pagewire-admin", "ha"), "pwctl")
    for what, c in (("node", node), ("admin pod", admin)):
        check(
            f"k8s {what}: PAGEWIRE_COORDINATOR = the {replicas} pods of {sts['metadata']['name']} under {headless}",
            env_value(c, "PAGEWIRE_COORDINATOR") == k8s_list,
            f"{env_value(c, 'PAGEWIRE_COORDINATOR')!r} vs {k8s_list!r}",
        )
    tcp_node = container(find(tcp_objs, "DaemonSet", "pagewire-node"), "node")
    tcp_pre = " ".join(tcp_node["lifecycle"]["preStop"]["exec"]["command"])
    pre = " ".join(((node.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", []))
    want_pre = re.sub(r"--coordinator \S+", '--coordinator "$PAGEWIRE_COORDINATOR"', tcp_pre)
    check(
        'k8s node preStop: the tcp overlay\'s drain with --coordinator "$PAGEWIRE_COORDINATOR"',
        pre == want_pre and want_pre != tcp_pre,
        f"{pre!r} vs the wanted {want_pre!r}",
    )
    rest = sorted(k for k in set(node) | set(tcp_node) if k not in ("env", "lifecycle") and node.get(k) != tcp_node.get(k))
    check("k8s node container is the tcp overlay's but for env and the preStop", not rest, f"differs in {rest}")
    check(
        "k8s node env is the tcp overlay's plus PAGEWIRE_COORDINATOR",
        [e for e in node.get("env", []) if e["name"] != "PAGEWIRE_COORDINATOR"] == tcp_node.get("env", []),
    )
    dn = set(env_map(services["node-1"].get("environment")))
    kn = {e["name"] for e in node.get("env", [])}
    check("node env names equal (compose HA vs k8s ha)", dn == kn, f"compose {sorted(dn)} vs k8s {sorted(kn)}")

    # -- etcd
    eb = etcd_image_build()
    etcd = {n: s for n, s in services.items() if str(s.get("image", "")).split(":")[0] == "pagewire-etcd"}
    ests = find(ha_objs, "StatefulSet", "pagewire-etcd", "ha")
    ec = container(ests, "etcd")
    ereplicas = ests["spec"].get("replicas", 1)
    check("compose HA runs 3 etcd members", len(etcd) == 3, f"compose: {sorted(etcd)}")
    check("k8s ha: StatefulSet pagewire-etcd has 3 replicas", ereplicas == 3, f"replicas {ereplicas}")
    kenv = {e["name"]: e.get("value") for e in ec.get("env", [])}
    members = kenv.get("PAGEWIRE_ETCD_MEMBERS", "")
    domain = kenv.get("PAGEWIRE_ETCD_DOMAIN", "")
    pods = [f"{ests['metadata']['name']}-{i}" for i in range(ereplicas)]
    check(
        "k8s etcd: PAGEWIRE_ETCD_MEMBERS names the StatefulSet's pods",
        members.split(",") == pods,
        f"{members!r} vs pods {pods}",
    )
    check(
        "k8s etcd: PAGEWIRE_ETCD_DOMAIN is the StatefulSet's headless Service",
        domain == ests["spec"]["serviceName"],
        f"{domain!r} vs serviceName {ests['spec']['serviceName']!r}",
    )
    for n, s in sorted(etcd.items()):
        e = env_map(s.get("environment"))
        nets = s.get("networks") or {}
        aliases = {a for v in (nets.values() if isinstance(nets, dict) else []) for a in ((v or {}).get("aliases") or [])}
        check(
            f"compose {n}: the k8s members and domain, its hostname in the list, reachable as {n}.{domain}",
            e.get("PAGEWIRE_ETCD_MEMBERS") == members
            and e.get("PAGEWIRE_ETCD_DOMAIN") == domain
            and s.get("hostname") == n
            and n in members.split(",")
            and f"{n}.{domain}" in aliases,
            f"env {e}, hostname {s.get('hostname')!r}, aliases {sorted(aliases)}",
        )
        check(f"compose {n}: same etcd image as k8s", s.get("image") == ec.get("image"), f"compose {s.get('image')} vs k8s {ec.get('image')}")
        check(
            f"compose {n}: env names = k8s etcd's",
            set(e) == set(kenv),
            f"compose {sorted(e)} vs k8s {sorted(kenv)}",
        )
        check(
            f"compose {n} and k8s etcd run the image's entrypoint (no command, entrypoint or args)",
            not any(s.get(k) for k in ("command", "entrypoint")) and not any(ec.get(k) for k in ("command", "args")),
        )
        dmnt = compose_mounts(s, {})
        kmnt = k8s_mounts(ests, ec)
        data = str(Path(eb["data"] or "/var/lib/etcd/data").parent)
        check(
            f"etcd data: {data} a compose volume in {n} and the k8s PVC",
            dmnt.get(data, {}).get("kind") == "volume" and kmnt.get(data, {}).get("kind") == "pvc"
            and set(dmnt) == set(kmnt),
            f"compose {dmnt}, k8s {sorted(kmnt)}",
        )
    check(
        f"the etcd image is k8s/image/etcd.sh's default tag {eb['tag']}",
        ec.get("image") == eb["tag"],
        f"k8s {ec.get('image')}",
    )
    check(
        "etcd.sh's image runs pagewire-etcd (the entrypoint) as uid 10002 = k8s runAsUser",
        eb["entrypoint"] == ["pagewire-etcd"]
        and eb["user"] == ec.get("securityContext", {}).get("runAsUser")
        == ests["spec"]["template"]["spec"].get("securityContext", {}).get("runAsUser"),
        f"ENTRYPOINT {eb['entrypoint']}, USER {eb['user']}",
    )
    client, peer = eb["client"], eb["peer"]
    kp = {p.get("name"): p["containerPort"] for p in ec.get("ports", [])}
    check(
        f"k8s etcd ports = the entrypoint's client {client} and peer {peer} = etcd.sh's EXPOSE",
        kp == {"client": client, "peer": peer} and eb["expose"] == {client, peer},
        f"k8s {kp}, EXPOSE {sorted(eb['expose'])}",
    )
    esvc = find(ha_objs, "Service", ests["spec"]["serviceName"], "ha")
    check(
        f"k8s Service {esvc['metadata']['name']}: headless, publishNotReadyAddresses, selects the members, ports client and peer",
        esvc["spec"].get("clusterIP") == "None"
        and esvc["spec"].get("publishNotReadyAddresses") is True
        and selects(esvc["spec"]["selector"], pod_labels(ests))
        and {p["name"]: p["port"] for p in esvc["spec"]["ports"]} == {"client": client, "peer": peer},
    )
    endpoints = [f"{m}.{domain}:{client}" for m in members.split(",")]
    check(
        f"{rel}: store names every member as MEMBER.DOMAIN:{client}",
        ha_toml.get("store") == "etcd://" + ",".join(endpoints),
        f"store {ha_toml.get('store')!r} vs etcd://{','.join(endpoints)}",
    )
    check(
        "k8s etcd: members start together (podManagementPolicy Parallel: a static bootstrap needs a quorum)",
        ests["spec"].get("podManagementPolicy") == "Parallel",
    )
    check("k8s etcd: at most one member per host (required anti-affinity on kubernetes.io/hostname)", anti_affinity_per_host(ests))
    epdb = pdb_for(ha_objs, ests, "ha")
    quorum = ereplicas // 2 + 1
    check(
        f"k8s etcd: the PDB keeps a quorum (minAvailable {quorum})",
        epdb is not None and epdb["spec"].get("minAvailable") == quorum,
        f"{epdb and epdb['spec']}",
    )
    rp = (ec.get("readinessProbe") or {}).get("httpGet") or {}
    lp = ec.get("livenessProbe") or {}
    lport = ((lp.get("tcpSocket") or lp.get("httpGet") or {}).get("port"))
    htest = " ".join(str(x) for x in ((next(iter(etcd.values()), {}).get("healthcheck") or {}).get("test") or []))
    check(
        f"etcd health on the client port {client}: k8s readiness GET /health, compose `etcdctl endpoint health` at 127.0.0.1:{client}",
        rp.get("path") == "/health" and rp.get("port") == client
        and re.search(rf"etcdctl .*--endpoints[ =]http://127\.0\.0\.1:{client}\b.* endpoint health", htest) is not None,
        f"k8s {rp}, compose {htest!r}",
    )
    check(f"k8s etcd liveness on the client port {client}", lport == client, f"{lp}")
    pol = find(ha_objs, "NetworkPolicy", "pagewire-etcd", "ha")["spec"]
    rules = [
        ({(p["port"], p.get("protocol", "TCP")) for p in r.get("ports", [])},
         [f["podSelector"].get("matchLabels", {}) for f in r.get("from", []) if "podSelector" in f])
        for r in pol.get("ingress", [])
    ]
    def admitted(port, obj):
        return any((port, "TCP") in ports and any(selects(f, pod_labels(obj)) for f in froms) for ports, froms in rules)
    others = [find(ha_objs, k, n, "ha") for k, n in (("DaemonSet", "pagewire-node"), ("Deployment", "pagewire-admin"))]
    check(
        f"NetworkPolicy pagewire-etcd: selects the members, {client} from the coordinators only, {peer} from the members only",
        selects(pol["podSelector"].get("matchLabels", {}), pod_labels(ests))
        and admitted(client, sts) and admitted(peer, ests)
        and not admitted(client, ests) and not admitted(peer, sts)
        and not any(admitted(p, o) for p in (client, peer) for o in others)
        and all(ports <= {(client, "TCP"), (peer, "TCP")} for ports, _ in rules),
        f"{rules}",
    )

    # -- ha-external: the same coordinators, a user's etcd, no etcd here
    print("ha-external: k8s/overlays/ha-external against ha:")
    xrel = HA_EXTERNAL_CONFIG.relative_to(REPO)
    x_text = HA_EXTERNAL_CONFIG.read_text()
    x_toml = tomllib.loads(x_text)
    check_base_but_ha_keys(xrel, base_toml, x_toml)
    top = toml_diff(ha_toml, x_toml)
    ediff = toml_diff(ha_toml.get("etcd", {}), x_toml.get("etcd", {}))
    check(
        f"{xrel} is {rel} but for store and [etcd] {', '.join(sorted(HA_EXTERNAL_ETCD_KEYS))}",
        top <= {"store", "etcd"} and ediff <= HA_EXTERNAL_ETCD_KEYS,
        f"differs in {sorted(top - {'store', 'etcd'})} and [etcd] {sorted(ediff - HA_EXTERNAL_ETCD_KEYS)}",
    )
    check(f"{xrel}: store is etcd://", str(x_toml.get("store", "")).startswith("etcd://"), f"{x_toml.get('store')!r}")
    xcm = config_map(hax_objs)
    check(
        f"ha-external: the ConfigMap's coordinator.toml is {xrel} byte for byte",
        xcm is not None and xcm["data"].get("coordinator.toml") == x_text,
    )
    etcd_left = sorted(f"{o['kind']} {o['metadata']['name']}" for o in hax_objs if "etcd" in o["metadata"]["name"] and o["kind"] != "Secret")
    check("ha-external: no etcd objects (no pagewire-etcd StatefulSet, Service, PDB, NetworkPolicy)", not etcd_left, f"{etcd_left}")
    xsts = find(hax_objs, "StatefulSet", "pagewire-coordinator", "ha-external")
    xc = container(xsts, "coordinator")
    xm = k8s_mounts(xsts, xc)
    tls_dirs = {p: v for p, v in xm.items() if v["kind"] == "secret" and v["volume"]["secret"]["secretName"].startswith("pagewire-etcd-tls")}
    secrets = {o["metadata"]["name"]: o for o in hax_objs if o["kind"] == "Secret"}
    files = {k: v for k, v in x_toml.get("etcd", {}).items() if k.endswith("_file")}
    for key, path in sorted(files.items()):
        d, name = str(Path(path).parent), Path(path).name
        sec = secrets.get(tls_dirs.get(d, {}).get("volume", {}).get("secret", {}).get("secretName", ""), {})
        check(
            f"ha-external: [etcd] {key} {path} is a key of the Secret pagewire-etcd-tls mounted at {d}",
            name in (sec.get("data") or {}) or name in (sec.get("stringData") or {}),
            f"mounted: {sorted(tls_dirs)}",
        )

    def unhashed(o) -> str:
        """The object as JSON with the generated names' hashes taken out
        (ConfigMap and Secret: different contents, different hashes)."""
        return re.sub(r'"(pagewire-(?:config|token))-[a-z0-9]{10}"', r'"\1"', json.dumps(o, sort_keys=True))

    def without_tls(o):
        o = json.loads(unhashed(o))
        ps = o["spec"]["template"]["spec"]
        ps["volumes"] = [v for v in ps.get("volumes", []) if v["name"] not in {t["volume"]["name"] for t in tls_dirs.values()}]
        for c in ps["containers"]:
            c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["mountPath"] not in tls_dirs]
        return o

    check(
        "ha-external: the coordinator StatefulSet is ha's but for the TLS mount (and the generated names)",
        without_tls(xsts) == without_tls(sts),
    )
    for kind, name in (("DaemonSet", "pagewire-node"), ("Deployment", "pagewire-admin"), ("PodDisruptionBudget", "pagewire-coordinator")):
        a, b = find(ha_objs, kind, name, "ha"), find(hax_objs, kind, name, "ha-external")
        check(f"ha-external: {kind} {name} is ha's (but for the generated names)", unhashed(a) == unhashed(b))
