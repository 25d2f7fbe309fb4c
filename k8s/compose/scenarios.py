#!/usr/bin/env python3
"""The compose cluster's fault scenarios (issue 9), every read verified.

Brings up k8s/compose/docker-compose.yml (a coordinator, node-1..3 and the
tools container, image pagewire:dev), waits until every node is ready, then
runs, each under a read loop from the tools container (`pagewire-bench
readloop`: one-sided tcp reads through ClusterClient, every byte checked
against the self-describing file, writes so that a stale read is caught,
and a prober that sweeps one page of every extent):

  1 kill       `docker kill` a node: time until the coordinator's map no
               longer names it, time until every extent is read again;
               0 wrong and 0 stale reads. The node is started again at a
               new address (it must rejoin there, same id), then stopped
               gracefully and started back at its own.
  2 rolling    `docker stop` (SIGTERM) and start each node in turn, waiting
               for it to be ready before the next: 0 failed, 0 wrong, 0
               stale reads; every node exits 0.
  3 partition  `docker network disconnect` a node for longer than the lease,
               then reconnect it: time until it is declared dead and its
               extents have moved, time until it has rejoined after the
               heal; 0 wrong and 0 stale reads.
  4 pause      `docker pause` a node for longer than its lease, unpause: it
               re-registers (a new incarnation), serves nothing stale
               (0 wrong and 0 stale reads) and rejoins.
  5 coordinator `docker restart` the coordinator (with --ha, the leading
               one): the same epoch and the same owner of every extent
               before and after (and a lease later).

With --ha the cluster is docker-compose.yml plus ha.yml: three etcd members
and three coordinators (one leads, elected on an etcd lease), and four more
scenarios run on it, each with 0 failed, 0 wrong and 0 stale reads:

  6 leader-kill `docker kill` the leading coordinator: time until another
               leads (within the etcd lease), the same map and no node
               registering again a node lease later, a map change under the
               new leader; the killed one comes back a follower.
  7 coordinators-rolling  `docker stop` (SIGTERM) and start each
               coordinator, the leader last: each exits 0, the leader hands
               over at once, the map and every node's incarnation unchanged.
  8 etcd-loss  `docker kill` one etcd member (a map change still goes
               through, 0 failed reads), then a second: every coordinator
               reports the store problem and none leads, a map change is
               refused with UNAVAILABLE, the epoch stays; reads go on for
               as long as the readers' trust in their map and the nodes'
               leases last (at least half a lease; measured), then wait for
               a leader (those past their deadline fail, counted); a member
               back: a leader again, reads flow and map changes resume.
  9 leader-cut-off  `docker network disconnect` the leader from the etcd
               network only (nodes and readers still reach it): another
               leads within the etcd lease, the old one says why it stopped,
               a map change goes through (the old one refuses, naming the
               new leader); healed, it is a follower again.

Every wait has a timeout; the cluster is torn down at the end whatever
happens (--keep leaves it up). Prints what each scenario covered and
measured, then one JSON summary line (also --json-out FILE). Exit status: 0
when every expectation held, 1 when one failed (a wrong or stale read among
them), 2 on a usage or set-up error.

  k8s/compose/scenarios.py [--ha] [--only 1,3] [-f override.yml] [--keep]

Python 3 standard library only; needs docker and docker-compose (1.29).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COMPOSE = os.path.join(HERE, "docker-compose.yml")
TOKEN = "/etc/pagewire/token/token"
NODES = ["node-1", "node-2", "node-3"]
NODE_IP = {"node-1": "10.213.7.11", "node-2": "10.213.7.12", "node-3": "10.213.7.13"}
# Where scenario 1 restarts a killed node (outside the compose file's
# 10.213.7.128/25 pool for other containers).
NEW_IP = {"node-2": "10.213.7.22"}
NAMES = {1: "kill", 2: "rolling", 3: "partition", 4: "pause", 5: "coordinator",
         6: "leader-kill", 7: "coordinators-rolling", 8: "etcd-loss", 9: "leader-cut-off"}
# The HA cluster (--ha: docker-compose.yml plus ha.yml): three coordinators
# over three etcd members; scenarios 6 to 9 need it.
HA = os.path.join(HERE, "ha.yml")
COORDS_HA = ["pagewire-coordinator", "pagewire-coordinator-2", "pagewire-coordinator-3"]
ETCDS = ["pagewire-etcd-0", "pagewire-etcd-1", "pagewire-etcd-2"]
HA_ONLY = {6, 7, 8, 9}


class Failed(Exception):
    """A set-up step failed (not an expectation of a scenario)."""


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, timeout=60, check=True, quiet=False, both=False):
    """Runs a command; returns its stdout (and stderr with `both`). Bounded by `timeout`."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"timed out after {timeout} s: {' '.join(cmd)}")
    if check and p.returncode != 0:
        raise Failed(
            f"exit {p.returncode}: {' '.join(cmd)}\n{(p.stderr or p.stdout).strip()[-2000:]}"
        )
    if not quiet and p.returncode != 0:
        log(f"(exit {p.returncode}) {' '.join(cmd)}: {p.stderr.strip()[-300:]}")
    return p.stdout + p.stderr if both else p.stdout


class Cluster:
    def __init__(self, args):
        self.args = args
        self.base = ["docker-compose", "-p", args.project, "-f", COMPOSE]
        if args.ha:
            self.base += ["-f", HA]
        # The coordinators' and etcd members' service names.
        self.coords = COORDS_HA if args.ha else ["pagewire-coordinator"]
        self.etcds = ETCDS if args.ha else []
        for f in args.override:
            self.base += ["-f", f]
        self.base += ["--profile", "tools"]
        self.ids = {}
        self.network = None
        self.etcd_network = None
        self.lease_s = 3.0
        # The coordinators' etcd lease (k8s/components/ha/coordinator.toml).
        self.etcd_ttl_s = 3.0

    def compose(self, *a, timeout=120, check=True):
        env_cmd = self.base + list(a)
        return run(env_cmd, timeout=timeout, check=check)

    def up(self):
        os.environ["PAGEWIRE_IMAGE"] = self.args.image
        os.environ["PAGEWIRE_FILE_MIB"] = str(self.args.file_mib)
        os.environ["PAGEWIRE_ETCD_IMAGE"] = self.args.etcd_image
        log(f"compose: down -v (a clean start), then up -d (project {self.args.project})")
        self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=120)
        self.compose("up", "-d", timeout=180)
        for s in self.coords + self.etcds + ["tools"] + NODES:
            cid = self.compose("ps", "-q", s, timeout=30).strip()
            if not cid:
                raise Failed(f"compose started no container for {s}")
            self.ids[s] = cid
        nets = json.loads(
            run(["docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", self.ids["node-1"]])
        )
        self.network = next(iter(nets))
        if self.etcds:
            nets = json.loads(
                run(["docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", self.ids[self.etcds[0]]])
            )
            self.etcd_network = next(iter(nets))

    def down(self):
        if self.args.keep:
            log(f"--keep: the cluster stays up (project {self.args.project})")
            return
        log("compose: down -v")
        try:
            self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=120, check=False)
        except Failed as e:
            log(f"teardown: {e}")

    def logs(self, services, tail=40):
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout=30, check=False)
        except Failed as e:
            return str(e)

    def docker(self, *a, timeout=60, check=True, both=False):
        return run(["docker", *a], timeout=timeout, check=check, both=both)

    def tools(self, *a, timeout=15, check=True):
        return self.docker("exec", self.ids["tools"], *a, timeout=timeout, check=check)

    def map(self):
        """`pwctl map --json --extents`, or None when the coordinator does not answer."""
        try:
            out = self.tools("pwctl", "--token-file", TOKEN, "--timeout-ms", "1000",
                             "map", "--json", "--extents", timeout=10, check=False)
            return json.loads(out) if out.strip() else None
        except (Failed, ValueError):
            return None

    def pwctl(self, *a, coordinator=None, timeout=10):
        """Runs pwctl in the tools container (at `coordinator`, a service
        name, or the list of all); returns (exit status, stdout + stderr)."""
        at = ["--coordinator", f"{coordinator}:7400"] if coordinator else []
        cmd = ["docker", "exec", self.ids["tools"], "pwctl", "--token-file", TOKEN, "--timeout-ms", "1000",
               *at, *a]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout} s"
        return p.returncode, (p.stdout + p.stderr).strip()

    def roles(self):
        """{coordinator service: its `pwctl status --json` or None}, every
        coordinator asked directly, at once."""
        script = " ".join(
            f"(o=$(pwctl --token-file {TOKEN} --timeout-ms 700 --coordinator {c}:7400 status --json "
            f"2>/dev/null | tr -d '\\n'); echo \"{c} $o\") &" for c in self.coords) + " wait"
        out = run(["docker", "exec", self.ids["tools"], "bash", "-c", script], timeout=15, check=False)
        got = {c: None for c in self.coords}
        for line in out.splitlines():
            name, _, js = line.partition(" ")
            if name in got and js.strip():
                try:
                    got[name] = json.loads(js)
                except ValueError:
                    pass
        return got

    def leader(self, roles=None):
        """The service name of the coordinator that says it leads, or None."""
        roles = roles or self.roles()
        leaders = [c for c, s in roles.items() if s and s.get("role") == "leader"]
        return leaders[0] if len(leaders) == 1 else None

    def nodes(self):
        try:
            out = self.tools("pwctl", "--token-file", TOKEN, "--timeout-ms", "1000",
                             "nodes", "--json", timeout=10, check=False)
            return {n["node_id"]: n for n in json.loads(out)} if out.strip() else None
        except (Failed, ValueError):
            return None

    def health(self, service):
        out = self.docker("inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                          self.ids[service], check=False).split()
        return out + [""] * (2 - len(out))

    def wait(self, what, pred, timeout, every=0.2):
        """Polls pred() until it is truthy; returns (value, seconds). Raises on timeout."""
        t0 = time.time()
        while True:
            v = pred()
            if v:
                return v, time.time() - t0
            if time.time() - t0 > timeout:
                raise Failed(f"timed out after {timeout} s waiting for {what}")
            time.sleep(every)

    def settled(self, m, alive=NODES):
        """The map names every node of `alive` alive with extents, none unowned or in handoff."""
        if not m or m.get("unowned") or m.get("in_handoff"):
            return False
        by = {n["node_id"]: n for n in m["nodes"]}
        return all(by.get(x, {}).get("state") == "alive" and by[x]["extents"] > 0 for x in alive)

    def ready(self, services):
        return all(self.health(s)[1] == "healthy" for s in services)

    def rejoin(self, node, timeout=60, stuck_s=None):
        """Waits until `node` is ready and the map settled with it alive and
        owning extents. A node that stays `drained` (0 extents) for longer
        than a lease and a half fails at once: it will not rejoin by itself."""
        stuck_s = stuck_s or self.lease_s * 1.5 + 2
        seen = {}

        def pred():
            if self.health(node)[0] in ("exited", "dead"):
                raise Failed(f"{node} exited:\n{self.logs([node], tail=15)}")
            m = self.map()
            n = owner_of(m, node)
            if n and n["state"] == "drained":
                t = seen.setdefault("drained", time.time())
                if time.time() - t > stuck_s:
                    raise Failed(f"{node} came back {n['state']} with {n['extents']} extents and stayed so "
                                 f"for {stuck_s:.1f} s: the coordinator kept the drain of its previous "
                                 f"incarnation (pwctl undrain {node} would give it extents again)")
            else:
                seen.pop("drained", None)
            return self.ready([node]) and self.settled(m)
        return self.wait(f"{node} ready, alive with extents, the map settled", pred, timeout, every=0.3)

    def repair(self):
        """After a failed scenario: every container running, drained nodes undrained."""
        for s in self.etcds + self.coords + NODES:
            st = self.health(s)[0]
            if st == "paused":
                self.docker("unpause", self.ids[s], check=False)
            elif st != "running":
                self.docker("start", self.ids[s], check=False)
        if self.network:
            for n in NODES:
                nets = self.docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", self.ids[n], check=False)
                if self.network not in nets:
                    self.docker("network", "connect", "--ip", NODE_IP[n], "--alias", n, self.network,
                                self.ids[n], check=False)
        if self.etcd_network:
            for co in self.coords:
                nets = self.docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", self.ids[co], check=False)
                if self.etcd_network not in nets:
                    self.docker("network", "connect", self.etcd_network, self.ids[co], check=False)
        time.sleep(self.lease_s)
        m = self.map()
        for n in (m or {}).get("nodes", []):
            if n["state"] == "drained":
                log(f"repair: pwctl undrain {n['node_id']}")
                self.tools("pwctl", "--token-file", TOKEN, "undrain", n["node_id"], check=False)

    def wait_cluster(self, timeout=120):
        everyone = self.etcds + self.coords + NODES

        def whole():
            for s in everyone:
                if self.health(s)[0] in ("exited", "dead"):
                    raise Failed(f"{s} exited:\n{self.logs([s], tail=15)}")
            return self.ready(everyone) and self.settled(self.map()) and (not self.etcds or self.leader())
        _, s = self.wait("every container healthy and the map settled", whole, timeout, every=0.5)
        return s


def owner_of(m, node):
    return next((n for n in m["nodes"] if n["node_id"] == node), None) if m else None


def names(m, node):
    """The map still gives `node` extents (or has it hand some off), or leaves some unowned."""
    n = owner_of(m, node)
    return m.get("unowned", 0) > 0 or (bool(n) and (n["extents"] > 0 or n["handing_off"] > 0))


def fault(c, res, *cmd):
    """Runs the docker command of a fault; returns when it returned (it is in effect)."""
    t = time.time()
    c.docker(*cmd)
    res["timings"]["docker_cmd_s"] = round(time.time() - t, 2)
    return time.time()


class ReadLoop:
    """`pagewire-bench readloop` in the tools container; its ticks as they come."""

    def __init__(self, c, args):
        cmd = ["docker", "exec", "-i", c.ids["tools"], "pagewire-bench", "readloop",
               "--token-file", TOKEN, "--transport", "tcp", "--until-eof",
               "--seconds", str(args.readloop_max_s), "--interval-ms", "200",
               "--threads", "2", "--read-rate", str(args.read_rate),
               "--writers", "1", "--write-rate", str(args.write_rate),
               "--op-deadline-ms", "10000", "--probe-deadline-ms", "250"]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.ticks, self.final, self.err = [], None, []
        self.lock = threading.Lock()
        self.t_out = threading.Thread(target=self._out, daemon=True)
        self.t_err = threading.Thread(target=self._err, daemon=True)
        self.t_out.start()
        self.t_err.start()

    def _out(self):
        for line in self.p.stdout:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                if "tick" in v:
                    self.ticks.append(v["tick"])
                elif "final" in v:
                    self.final = v["final"]

    def _err(self):
        for line in self.p.stderr:
            self.err.append(line.rstrip())

    def flowing(self, since_ms, reads=20):
        with self.lock:
            return sum(t["ok"] for t in self.ticks if t["unix_ms"] > since_ms) >= reads

    def stop(self, timeout=30):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=10)
        self.t_out.join(timeout=5)
        return self.p.returncode

    def sweeps_after(self, ms):
        """(start, end) of the first clean sweep that started at or after `ms`."""
        with self.lock:
            for t in self.ticks:
                for s, e in t["sweeps"]:
                    if s >= ms:
                        return s, e
        return None

    def served_until(self, since_ms):
        """unix ms of the last tick after `since_ms` that had reads answered."""
        with self.lock:
            return max((t["unix_ms"] for t in self.ticks if t["unix_ms"] > since_ms and t["ok"] > 0), default=None)

    def summary(self, from_ms=0, until_ms=None):
        with self.lock:
            ts = [t for t in self.ticks if t["unix_ms"] >= from_ms and (until_ms is None or t["unix_ms"] < until_ms)]
        tot = {k: sum(t[k] for t in ts) for k in ["ok", "err", "wrong", "stale", "wr", "wr_err"]}
        tot["max_read_ms"] = max((t["max_ms"] for t in ts), default=0.0)
        samples = [s for t in ts for s in t["samples"]]
        tot["samples"] = samples[:5]
        return tot


def ms(t):
    return int(t * 1000)


class Runner:
    def __init__(self, c, args):
        self.c, self.args = c, args
        self.results = []

    def scenario(self, num, body):
        name = NAMES[num]
        log(f"scenario {num} ({name}): start")
        res = {"scenario": num, "name": name, "ok": False, "expect": [], "timings": {}}
        rl = ReadLoop(self.c, self.args)
        t_start = time.time()
        try:
            self.c.wait("the read loop to read", lambda: rl.flowing(ms(t_start)), 30)
            time.sleep(self.args.settle_s)
            body(rl, res)
            time.sleep(self.args.settle_s)
        except Failed as e:
            res["error"] = str(e)
            log(f"scenario {num} ({name}): {e}")
        finally:
            rc = rl.stop()
        reads = rl.summary()
        fin = rl.final or {}
        res["reads"] = reads
        res["readloop"] = {k: fin.get(k) for k in ["reads", "errors", "wrong", "stale", "writes", "write_errors",
                                                     "clean_sweeps", "one_sided", "fault_ins", "retries",
                                                     "reconnects", "first_error", "first_wrong"]}
        res["readloop"]["exit"] = rc
        if rl.final is None:
            res["expect"].append(["the read loop ended with its totals", False,
                                  "; ".join(rl.err[-5:]) or f"exit {rc}"])
        wrong = fin.get("wrong", reads["wrong"]) or 0
        stale = fin.get("stale", reads["stale"]) or 0
        res["expect"].append(["0 wrong reads", wrong == 0, wrong])
        res["expect"].append(["0 stale reads", stale == 0, stale])
        res["ok"] = "error" not in res and all(e[1] for e in res["expect"])
        if not res["ok"]:
            res["logs"] = self.c.logs(self.c.etcds + self.c.coords + NODES, tail=30)
        self.results.append(res)
        tm = "  ".join(f"{k}={v}" for k, v in res["timings"].items())
        log(f"scenario {num} ({name}): {'ok' if res['ok'] else 'FAILED'}  {tm}  reads ok={reads['ok']} "
            f"failed={reads['err']} wrong={wrong} stale={stale} writes={reads['wr']} write_errors={reads['wr_err']}")
        for e in res["expect"]:
            if not e[1]:
                log(f"    expectation failed: {e[0]} (got {e[2]})")
        # Whatever happened, the next scenario starts from a whole cluster.
        try:
            self.c.wait_cluster(timeout=30)
        except Failed as e:
            log(f"after scenario {num}: the cluster is not whole ({str(e).splitlines()[0]}); repairing")
            self.c.repair()
            try:
                self.c.wait_cluster(timeout=45)
            except Failed as e2:
                raise Failed(f"after scenario {num}: the cluster did not come back whole: {e2}")

    def expect(self, res, what, ok, got):
        res["expect"].append([what, bool(ok), got])

    def applied(self, res, node):
        """Waits until `node` reports (in a heartbeat) the coordinator's current epoch."""
        c = self.c
        def current():
            m, n = c.map(), (c.nodes() or {}).get(node)
            return m and n and n.get("applied_epoch") == m["epoch"] and (n["applied_epoch"],)
        try:
            v, s = c.wait(f"{node} to apply the current map", current, timeout=15, every=0.3)
            self.expect(res, f"{node} applied the current epoch after it rejoined", True, v[0])
        except Failed as e:
            self.expect(res, f"{node} applied the current epoch after it rejoined", False, str(e))

    # 1: docker kill a node.
    def kill(self, rl, res):
        c, node, lease = self.c, "node-2", self.c.lease_s
        t0 = fault(c, res, "kill", c.ids[node])
        m, _ = c.wait(f"the map to drop {node}", lambda: (lambda m: m and not names(m, node) and m)(c.map()),
                      timeout=lease * 4 + 10)
        t_moved = time.time()
        res["timings"]["reassigned_s"] = round(t_moved - t0, 2)
        sw, _ = c.wait("a clean sweep of every extent", lambda: rl.sweeps_after(ms(t0)), timeout=30)
        res["timings"]["all_extents_served_s"] = round(sw[1] / 1000 - t0, 2)
        self.expect(res, f"reassigned within the lease (+1 s for the lease check and this poll: {lease + 1:.1f} s)",
                    t_moved - t0 <= lease + 1, res["timings"]["reassigned_s"])
        time.sleep(1)
        # Started again at a new address (a rescheduled pod): the node
        # advertises it by itself and rejoins with the same id.
        self.move(node, NEW_IP[node])
        res["timings"]["restart_to_rejoined_s"] = self.start(node)
        self.expect_address(res, node, NEW_IP[node])
        # And back, through a graceful stop: after a planned leave the id is
        # free at once, at any address.
        self.stop(node)
        self.move(node, NODE_IP[node])
        res["timings"]["graceful_restart_back_rejoined_s"] = self.start(node)
        self.expect_address(res, node, NODE_IP[node])

    def stop(self, node):
        """`docker stop` (SIGTERM, then SIGKILL after --stop-timeout); seconds it took."""
        t = time.time()
        self.c.docker("stop", "-t", str(self.args.stop_timeout), self.c.ids[node],
                      timeout=self.args.stop_timeout + 30)
        return round(time.time() - t, 2)

    def start(self, node):
        """`docker start`, then waits until `node` has rejoined; seconds it took."""
        t = time.time()
        self.c.docker("start", self.c.ids[node])
        self.c.rejoin(node)
        return round(time.time() - t, 2)

    def move(self, node, ip):
        """Gives the (stopped) container of `node` the address `ip`."""
        c = self.c
        c.docker("network", "disconnect", c.network, c.ids[node])
        c.docker("network", "connect", "--ip", ip, "--alias", node, c.network, c.ids[node])

    def expect_address(self, res, node, ip):
        n = (self.c.nodes() or {}).get(node) or {}
        got = n.get("grpc_address", "")
        self.expect(res, f"{node} rejoined at {ip}", got == f"{ip}:7500", got)

    # 2: rolling restart with SIGTERM.
    def rolling(self, rl, res):
        c = self.c
        t0 = time.time()
        start_ms = ms(t0)
        for node in NODES:
            t = time.time()
            res["timings"][f"{node}_stop_s"] = self.stop(node)
            code = c.docker("inspect", "-f", "{{.State.ExitCode}}", c.ids[node]).strip()
            self.expect(res, f"{node} exits 0 on SIGTERM", code == "0", code)
            said = [l.split("  ", 1)[-1][:160] for l in c.docker(
                "logs", "--since", str(int(t - 1)), c.ids[node], check=False, both=True).splitlines()
                if "drain" in l or "hand over" in l]
            self.expect(res, f"{node} drained through a planned handoff",
                        any("every extent handed over" in l for l in said), said[-1:] or "no drain in its log")
            res["timings"][f"{node}_ready_s"] = self.start(node)
        res["timings"]["total_s"] = round(time.time() - t0, 2)
        time.sleep(1)
        r = rl.summary(start_ms)
        self.expect(res, "0 failed reads during the rolling restart", r["err"] == 0, r["err"])

    # 3: network partition.
    def partition(self, rl, res):
        c, node, lease = self.c, "node-2", self.c.lease_s
        before = (c.nodes() or {}).get(node, {}).get("incarnation")
        t0 = fault(c, res, "network", "disconnect", c.network, c.ids[node])
        m, _ = c.wait(f"{node} declared dead and its extents moved",
                      lambda: (lambda m: m and not names(m, node) and owner_of(m, node)
                               and owner_of(m, node)["state"] != "alive" and m)(c.map()),
                      timeout=lease * 4 + 10)
        res["timings"]["declared_dead_s"] = round(time.time() - t0, 2)
        self.expect(res, f"declared dead within the lease (+1 s for the lease check and this poll: {lease + 1:.1f} s)",
                    time.time() - t0 <= lease + 1, res["timings"]["declared_dead_s"])
        sw, _ = c.wait("a clean sweep of every extent", lambda: rl.sweeps_after(ms(t0)), timeout=30)
        res["timings"]["all_extents_served_s"] = round(sw[1] / 1000 - t0, 2)
        hold = max(0.0, t0 + 2 * lease + 1 - time.time())
        time.sleep(hold)
        res["timings"]["cut_for_s"] = round(time.time() - t0, 2)
        t1 = time.time()
        c.docker("network", "connect", "--ip", NODE_IP[node], "--alias", node, c.network, c.ids[node])
        c.rejoin(node)
        res["timings"]["rejoined_after_heal_s"] = round(time.time() - t1, 2)
        self.applied(res, node)
        after = (c.nodes() or {}).get(node, {}).get("incarnation")
        res["timings"]["incarnation"] = f"{before}->{after}"
        self.expect(res, f"{node} registered again (a new incarnation)", after is not None and after != before,
                    f"{before}->{after}")

    # 4: pause past the lease.
    def pause(self, rl, res):
        c, node, lease = self.c, "node-3", self.c.lease_s
        before = (c.nodes() or {}).get(node, {}).get("incarnation")
        t0 = fault(c, res, "pause", c.ids[node])
        try:
            c.wait(f"{node} declared dead and its extents moved",
                   lambda: (lambda m: m and not names(m, node) and m)(c.map()), timeout=lease * 4 + 10)
            res["timings"]["declared_dead_s"] = round(time.time() - t0, 2)
            self.expect(res, f"declared dead within the lease (+1 s for the lease check and this poll: {lease + 1:.1f} s)",
                        time.time() - t0 <= lease + 1, res["timings"]["declared_dead_s"])
            sw, _ = c.wait("a clean sweep of every extent", lambda: rl.sweeps_after(ms(t0)), timeout=30)
            res["timings"]["all_extents_served_s"] = round(sw[1] / 1000 - t0, 2)
            # Frozen well past the lease, while the writes go to the new owners.
            time.sleep(max(0.0, t0 + 2 * lease + 2 - time.time()))
        finally:
            res["timings"]["paused_for_s"] = round(time.time() - t0, 2)
            c.docker("unpause", c.ids[node])
        t1 = time.time()
        c.rejoin(node)
        res["timings"]["rejoined_after_unpause_s"] = round(time.time() - t1, 2)
        self.applied(res, node)
        after = (c.nodes() or {}).get(node, {}).get("incarnation")
        res["timings"]["incarnation"] = f"{before}->{after}"
        self.expect(res, f"{node} noticed its lost lease and registered again (a new incarnation)",
                    after is not None and after != before, f"{before}->{after}")
        logs = c.docker("logs", "--since", str(int(t1 - 1)), c.ids[node], check=False, timeout=20, both=True)
        res["node_log_after_unpause"] = [l for l in (logs or "").splitlines()
                                         if "lease" in l or "register" in l][:6]

    # 5: coordinator restart (on the HA cluster: the leader's).
    def coordinator(self, rl, res):
        c, lease = self.c, self.c.lease_s
        before = c.map()
        if not before:
            raise Failed("no map before the restart")
        target = (c.leader() if c.etcds else None) or c.coords[0]
        res["timings"]["restarted"] = target
        t0 = time.time()
        c.docker("restart", "-t", "10", c.ids[target], timeout=60)
        res["timings"]["docker_restart_s"] = round(time.time() - t0, 2)
        after, _ = c.wait("the coordinator to answer again", c.map, timeout=60)
        res["timings"]["map_served_after_s"] = round(time.time() - t0, 2)
        c.wait("the coordinator ready", lambda: c.ready([target]), timeout=60)
        res["timings"]["ready_after_s"] = round(time.time() - t0, 2)
        time.sleep(lease * 1.5)
        later = c.map()
        strip = lambda m: {"epoch": m["epoch"], "runs": m.get("runs"),
                           "nodes": sorted((n["node_id"], n["state"], n["extents"]) for n in m["nodes"])}
        b, a, l = strip(before), strip(after), strip(later) if later else None
        res["timings"]["epoch"] = f"{b['epoch']}->{a['epoch']}->{l['epoch'] if l else None}"
        self.expect(res, "same epoch after the restart", a["epoch"] == b["epoch"], res["timings"]["epoch"])
        self.expect(res, "same owner of every extent after the restart", a["runs"] == b["runs"],
                    "same" if a["runs"] == b["runs"] else "differs")
        self.expect(res, "same epoch and owners a lease and a half later", l == b,
                    "same" if l == b else (l and l["epoch"]))

    # The HA scenarios' common parts.
    def new_leader(self, res, old, t0, what):
        """Waits until a coordinator other than `old` leads; records and
        checks the time from `t0` (the fault) against the etcd lease."""
        c, ttl = self.c, self.c.etcd_ttl_s

        def other():
            lead = c.leader()
            return lead if lead and lead != old else None
        new, _ = c.wait(f"a coordinator other than {old} to lead", other, timeout=ttl * 4 + 15, every=0.1)
        took = round(time.time() - t0, 2)
        res["timings"]["new_leader_s"] = took
        res["timings"]["new_leader"] = new
        # The etcd lease, then a follower's next campaign (its retry backs
        # off up to 1 s, coordinator/src/store/etcd.rs), then this poll (three
        # pwctl calls through docker exec, up to about 1 s on a loaded host).
        bound = ttl + 2
        self.expect(res, f"{what}: a new leader within the etcd lease (+1 s for the followers' campaign retry, "
                    f"+1 s for this poll: {bound:.1f} s)", took <= bound, took)
        return new

    def unchanged(self, res, before, nodes_before, what):
        """The map's epoch and owners, and every node's incarnation, are
        what they were before (no map change, no node lost its lease)."""
        c = self.c
        after, n_after = c.map(), c.nodes() or {}
        strip = lambda m: m and (m["epoch"], m.get("runs"))
        self.expect(res, f"{what}: the same epoch and owners", strip(after) == strip(before),
                    f"{before['epoch']}->{after and after['epoch']}")
        inc = lambda ns: {k: v.get("incarnation") for k, v in ns.items()}
        self.expect(res, f"{what}: no node registered again (none lost its lease)",
                    inc(n_after) == inc(nodes_before), "same" if inc(n_after) == inc(nodes_before)
                    else f"{inc(nodes_before)} -> {inc(n_after)}")

    def no_failed_reads(self, rl, res, since_ms, what, until_ms=None):
        time.sleep(1)
        r = rl.summary(since_ms, until_ms)
        self.expect(res, f"0 failed reads {what}", r["err"] == 0, r["err"])

    def map_change(self, res, what, timeout, node="node-3"):
        """`pwctl drain NODE --wait` then `undrain`, retried until both are
        taken or `timeout`; waits for the map to settle; returns seconds."""
        c = self.c
        t0 = time.time()
        last = ""
        for verb in (["drain", node, "--wait", "20"], ["undrain", node]):
            while True:
                rc, out = c.pwctl(*verb, timeout=40)
                if rc == 0:
                    break
                last = out.splitlines()[-1][:200] if out else f"exit {rc}"
                if time.time() - t0 > timeout:
                    self.expect(res, f"{what}: pwctl {verb[0]} taken", False, last)
                    return None
                time.sleep(0.5)
        took = round(time.time() - t0, 2)
        c.rejoin(node)
        return took

    def leader_and_state(self, before_what):
        """The leader, the map and the nodes before a fault to the leader."""
        c = self.c
        old = c.leader()
        if not old:
            raise Failed(f"no leader before {before_what}")
        return old, c.map(), c.nodes() or {}

    # 6: docker kill the leading coordinator.
    def leader_kill(self, rl, res):
        c = self.c
        old, before, nodes_before = self.leader_and_state("the kill")
        res["timings"]["killed"] = old
        t0 = fault(c, res, "kill", c.ids[old])
        self.new_leader(res, old, t0, "leader killed")
        time.sleep(c.lease_s)
        self.unchanged(res, before, nodes_before, "a node lease after the failover")
        took = self.map_change(res, "under the new leader", timeout=30)
        res["timings"]["map_change_after_s"] = took
        t1 = time.time()
        c.docker("start", c.ids[old])
        c.wait(f"{old} ready again", lambda: c.ready([old]) and c.leader(), timeout=60)
        res["timings"]["killed_one_back_s"] = round(time.time() - t1, 2)
        role = (c.roles().get(old) or {}).get("role")
        self.expect(res, f"{old} came back a follower", role == "follower", role)
        self.no_failed_reads(rl, res, ms(t0), "from the kill to the end")

    # 7: rolling restart (SIGTERM) of every coordinator, the leader last.
    def coordinators_rolling(self, rl, res):
        c = self.c
        before, nodes_before = c.map(), c.nodes() or {}
        lead = c.leader()
        if not lead:
            raise Failed("no leader before the restart")
        order = [x for x in c.coords if x != lead] + [lead]
        t0 = time.time()
        for co in order:
            t = time.time()
            c.docker("stop", "-t", "10", c.ids[co], timeout=40)
            code = c.docker("inspect", "-f", "{{.State.ExitCode}}", c.ids[co]).strip()
            self.expect(res, f"{co} exits 0 on SIGTERM", code == "0", code)
            if co == lead:
                self.new_leader(res, co, t, "the leader stopped (it gives up its lease)")
            c.docker("start", c.ids[co])
            c.wait(f"{co} ready", lambda: c.ready([co]) and c.leader(), timeout=60)
            res["timings"][f"{co}_s"] = round(time.time() - t, 2)
        res["timings"]["total_s"] = round(time.time() - t0, 2)
        self.unchanged(res, before, nodes_before, "after the rolling restart")
        self.no_failed_reads(rl, res, ms(t0), "during the rolling restart")

    # 8: etcd members lost: one (no effect), then two (no quorum).
    def etcd_loss(self, rl, res):
        c = self.c
        first, second = c.etcds[0], c.etcds[1]
        t0 = fault(c, res, "kill", c.ids[first])
        took = self.map_change(res, f"{first} killed", timeout=30)
        res["timings"]["one_down_map_change_s"] = took
        epoch = (c.map() or {}).get("epoch")
        t1 = time.time()
        c.docker("kill", c.ids[second])

        def all_refuse():
            r = c.roles()
            return all(s and s.get("store_problem") and s.get("role") != "leader" for s in r.values()) and r
        roles, _ = c.wait("every coordinator to report the store problem and none to lead", all_refuse,
                          timeout=c.etcd_ttl_s * 4 + 15, every=0.3)
        res["timings"]["quorum_loss_reported_s"] = round(time.time() - t1, 2)
        res["store_problem"] = next(iter(roles.values())).get("store_problem")
        rc, out = c.pwctl("drain", "node-3")
        self.expect(res, "without quorum a map change is refused with UNAVAILABLE",
                    rc != 0 and "unavailable" in out.lower(), out.splitlines()[-1][:200] if out else rc)
        # Without quorum no coordinator can confirm the map or renew a
        # lease: readers trust their map, and nodes serve, for one lease
        # after the last confirmation (ARCHITECTURE.md, "Coordinator
        # failover"), then reads wait for a leader. Held two leases and a
        # second, to see where they stop.
        time.sleep(max(0.0, t1 + 2 * c.lease_s + 1 - time.time()))
        served = rl.served_until(ms(t1))
        res["timings"]["reads_served_after_quorum_loss_s"] = round(served / 1000 - t1, 2) if served else 0
        self.expect(res, f"reads served for at least half a node lease ({c.lease_s / 2:.1f} s) after the "
                    f"quorum loss", served and served / 1000 - t1 >= c.lease_s / 2,
                    res["timings"]["reads_served_after_quorum_loss_s"])
        epochs = {k: s and s.get("epoch") for k, s in c.roles().items()}
        self.expect(res, "no coordinator moved the epoch without quorum",
                    all(e in (None, epoch) for e in epochs.values()), epochs)
        t3 = time.time()
        c.docker("start", c.ids[second])
        c.wait("a leader once a member returned", c.leader, timeout=60, every=0.3)
        res["timings"]["leader_after_member_back_s"] = round(time.time() - t3, 2)
        c.wait("reads to flow again", lambda: rl.flowing(ms(time.time() - 0.5), reads=50), timeout=30)
        res["timings"]["reads_again_after_member_back_s"] = round(time.time() - t3, 2)
        res["timings"]["quorum_lost_for_s"] = round(t3 - t1, 2)
        took = self.map_change(res, "a member back", timeout=30)
        res["timings"]["map_change_after_member_back_s"] = took
        c.docker("start", c.ids[first])
        c.wait(f"{first} healthy", lambda: c.ready([first]), timeout=60)
        self.no_failed_reads(rl, res, ms(t0), "from the first etcd kill to the quorum loss", until_ms=ms(t1))
        # A read that waited for a leader past its deadline (--op-deadline-ms)
        # failed: counted, not an expectation (each read thread at most once
        # per deadline the quorum stays lost).
        time.sleep(1)
        res["timings"]["reads_failed_waiting_for_quorum"] = rl.summary(ms(t1))["err"]

    # 9: the leader cut off from etcd (its etcd network), nodes still reach it.
    def leader_cut_off(self, rl, res):
        c = self.c
        old, before, nodes_before = self.leader_and_state("the cut")
        res["timings"]["cut_off"] = old
        t0 = fault(c, res, "network", "disconnect", c.etcd_network, c.ids[old])
        try:
            self.new_leader(res, old, t0, "leader cut off from etcd")
            s = c.roles().get(old) or {}
            self.expect(res, f"{old} stopped leading and says why", s.get("role") != "leader"
                        and bool(s.get("store_problem")), f"{s.get('role')}: {s.get('store_problem')}")
            time.sleep(c.lease_s)
            self.unchanged(res, before, nodes_before, "a node lease after the failover")
            # A map change while the old leader still answers the nodes and
            # readers: it refuses and names the new leader.
            res["timings"]["map_change_during_cut_s"] = self.map_change(res, "during the cut", timeout=30)
            res["timings"]["cut_for_s"] = round(time.time() - t0, 2)
        finally:
            c.docker("network", "connect", c.etcd_network, c.ids[old])
        t1 = time.time()

        def back():
            s = c.roles().get(old) or {}
            return c.ready([old]) and s.get("role") == "follower" and not s.get("store_problem")
        c.wait(f"{old} back as a follower", back, timeout=60, every=0.3)
        res["timings"]["follower_again_after_heal_s"] = round(time.time() - t1, 2)
        self.no_failed_reads(rl, res, ms(t0), "from the cut to the end")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--project", default="pagewire-scenarios", help="compose project name")
    ap.add_argument("--image", default=os.environ.get("PAGEWIRE_IMAGE", "pagewire:dev"))
    ap.add_argument("-f", "--override", action="append", default=[], help="an extra compose file")
    ap.add_argument("--ha", action="store_true",
                    help="the HA cluster (ha.yml: 3 etcd members, 3 coordinators); default scenarios 1-9")
    ap.add_argument("--etcd-image", default=os.environ.get("PAGEWIRE_ETCD_IMAGE", "pagewire-etcd:dev"))
    ap.add_argument("--only", default=None, help="scenarios to run, e.g. 1,3 (default 1-5; 1-9 with --ha)")
    ap.add_argument("--file-mib", type=int, default=256)
    ap.add_argument("--read-rate", type=float, default=400, help="reads/s of each of the 2 read threads")
    ap.add_argument("--write-rate", type=float, default=50, help="writes/s of the writer")
    ap.add_argument("--stop-timeout", type=int, default=30, help="docker stop -t (above the node's drain timeout)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="reads before and after each fault")
    ap.add_argument("--readloop-max-s", type=int, default=240, help="a read loop's own time limit")
    ap.add_argument("--budget-s", type=int, default=None,
                    help="the whole run's time limit (default 540 s; 1080 s with --ha)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--json-out", help="also write the JSON summary here")
    args = ap.parse_args()
    if args.only is None:
        args.only = "1,2,3,4,5,6,7,8,9" if args.ha else "1,2,3,4,5"
    if args.budget_s is None:
        args.budget_s = 1080 if args.ha else 540
    try:
        only = [int(x) for x in args.only.split(",") if x.strip()]
        assert only and all(x in NAMES for x in only)
    except (ValueError, AssertionError):
        ap.error("--only: numbers from 1 to 9, comma-separated")
    if not args.ha and set(only) & HA_ONLY:
        ap.error(f"--only: scenarios {sorted(set(only) & HA_ONLY)} need the HA cluster (--ha)")

    for tool in ["docker", "docker-compose"]:
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            print(f"scenarios.py: {tool} not found", file=sys.stderr)
            return 2
    if subprocess.run(["docker", "image", "inspect", args.image], capture_output=True).returncode != 0:
        print(f"scenarios.py: no image {args.image}: build it with k8s/image/build.sh", file=sys.stderr)
        return 2
    if args.ha and subprocess.run(["docker", "image", "inspect", args.etcd_image],
                                  capture_output=True).returncode != 0:
        print(f"scenarios.py: no image {args.etcd_image}: build it with k8s/image/etcd.sh", file=sys.stderr)
        return 2

    # SIGTERM tears down like Ctrl-C; SIGALRM bounds the whole run.
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGALRM, on_signal)
    signal.alarm(args.budget_s)

    c = Cluster(args)
    runner = Runner(c, args)
    t0 = time.time()
    summary = {"image": args.image, "scenarios": runner.results}
    rc = 0
    try:
        size = run(["docker", "image", "inspect", "-f", "{{.Size}}", args.image]).strip()
        summary["image_size_mb"] = round(int(size) / 1e6, 1)
        c.up()
        # The coordinators' config: the node lease, and the etcd lease.
        toml = os.path.join(HERE, "..", *(["components", "ha"] if args.ha else ["base", "config"]),
                            "coordinator.toml")
        for key, attr, scale in (("lease_ms", "lease_s", 1000), ("lease_ttl_s", "etcd_ttl_s", 1)):
            cfg = run(["grep", "-E", rf"^\s*{key}\s*=", toml], check=False)
            if cfg.strip():
                setattr(c, attr, int(cfg.split("=")[1].split("#")[0].strip()) / scale)
        summary["lease_s"] = c.lease_s
        if args.ha:
            summary["etcd_lease_ttl_s"] = c.etcd_ttl_s
        summary["cluster_ready_s"] = round(c.wait_cluster(timeout=120), 2)
        log(f"cluster ready in {summary['cluster_ready_s']} s (lease {c.lease_s} s, etcd lease {c.etcd_ttl_s} s, "
            f"network {c.network})")
        for n in only:
            runner.scenario(n, getattr(runner, NAMES[n].replace("-", "_")))
    except KeyboardInterrupt as e:
        summary["error"] = f"interrupted ({e or 'SIGINT'})"
        rc = 1
    except Failed as e:
        summary["error"] = str(e)
        log(f"set-up failed: {e}")
        log(c.logs(["init"] + c.etcds + c.coords + NODES, tail=20))
        rc = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        c.down()
    summary["total_s"] = round(time.time() - t0, 1)
    summary["ok"] = rc == 0 and len(runner.results) == len(only) and all(r["ok"] for r in runner.results)

    print("\ncovered:")
    for r in runner.results:
        print(f"  {r['scenario']} {r['name']:<12} {'ok    ' if r['ok'] else 'FAILED'} "
              + "  ".join(f"{k}={v}" for k, v in r["timings"].items()))
        rd = r["reads"]
        print(f"    reads ok={rd['ok']} failed={rd['err']} wrong={rd['wrong']} stale={rd['stale']} "
              f"writes={rd['wr']} write_errors={rd['wr_err']} longest_read_ms={rd['max_read_ms']}")
        for e in r["expect"]:
            print(f"    [{'x' if e[1] else ' '}] {e[0]}: {e[2]}")
        if "error" in r:
            print(f"    error: {r['error']}")
    missing = [NAMES[n] for n in only if n not in [r["scenario"] for r in runner.results]]
    if missing:
        print(f"  not run: {', '.join(missing)}")
    if "error" in summary:
        print(f"  error: {summary['error']}")
    print(f"  total {summary['total_s']} s; {'all expectations held' if summary['ok'] else 'FAILED'}")
    logs = {r["scenario"]: r.pop("logs") for r in runner.results if "logs" in r}
    line = json.dumps(summary)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    for n, text in logs.items():
        print(f"\n--- logs after scenario {n} ({NAMES[n]}) ---\n{text}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
