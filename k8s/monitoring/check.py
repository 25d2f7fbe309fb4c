#!/usr/bin/env python3
"""Checks that every dashboard query and every alert expression returns data
against a live pagewire cluster (python3 standard library only).

It starts a real Prometheus on 127.0.0.1 (a free port, a temporary storage
folder, scrape_interval 1s) scraping the given coordinator and node HTTP
ports (and --client ports, job pagewire-client: a program's client-library
metrics, which come up with the load and are waited for after it starts),
waits until every coordinator and node target is up, lets the cluster serve a read load for
--load-seconds (the caller's, a --load-cmd this script starts, and/or
--proxy-reads), then evaluates over the HTTP API:

* every query of every dashboard panel, with $__rate_interval, $__interval
  and the dashboard variables substituted (a multi-value variable takes its
  allValue, or the regex of the values its own query finds), as a range
  query over the load window: it must return at least one series with at
  least one number (a series that is NaN throughout, e.g. a ratio whose
  denominator never moved, counts as blank);
* every variable's query (label_values(metric, label)): it must find values;
* every alert expression, by this rule: the expression as written must
  evaluate without error (it returns data only while the alert fires, so
  an empty answer is fine); and each operand of its top-level `and`/`or`/
  `unless`, with that operand's top-level comparison (`==`, `!=`, `>`, `<`,
  `>=`, `<=`, with `bool` and the matching clause) removed, must return
  data. `absent(X)` / `absent_over_time(X)` is checked as X. So an alert on
  a metric that does not exist (a typo, a missing `_total`) fails even
  though its expression is valid and silent;
* every metric name any of those expressions names must have a series in
  Prometheus (so `x or vector(0)` cannot hide a metric that does not exist);
* with --client: every client family has a series, and the one-sided read
  count, one_sided_total and reads_total went up in the window (a read load
  through the client reads one-sidedly), every path label present;

and runs `promtool check rules` on the rules file. It prints one table row
per check (its series count, ok/FAIL, the last value of its series, or their
range, the query) and exits 1 if any check
fails, 2 on a usage error. Prometheus and anything it started are stopped at
the end, always (also on Ctrl-C, SIGTERM and --timeout; Prometheus is also
tied to this process with PR_SET_PDEATHSIG).

--proxy-reads HOST:PORT,... sends gRPC `Read`s of single pages round-robin to
every node's gRPC port (a minimal HTTP/2 client, below): a node asked for a
page of an extent it does not own reads it one-sidedly from the owner, the
only reads that move the nodes' pagewire_node_remote_* counters (a client
library reader reads the owner directly, and the owner counts none of its
one-sided reads). Every page is checked against the self-describing file
(its first 8 bytes are its page number). --provoke-rpc-error sends one
`Undrain` of a node id that does not exist to the coordinator, so that
pagewire_coordinator_rpc_errors_total has a series (the family has none
until a call fails).
"""

import argparse
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- PromQL


KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "and", "or", "unless", "inf", "nan", "atan2",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
    "count_values", "bottomk", "topk", "quantile",
}
LABEL_LIST_KW = {"by", "without", "on", "ignoring", "group_left", "group_right"}
SET_OPS = {"and", "or", "unless"}
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _scan(expr):
    """Yields (index, char, depth, in_string) for every char of expr, depth
    counting (), [] and {}; strings ("", '', ``) are opaque."""
    depth, quote, i = 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            yield i, c, depth, True
            if c == "\\" and quote != "`":
                i += 1
                if i < len(expr):
                    yield i, expr[i], depth, True
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
            yield i, c, depth, True
        else:
            if c in ")]}":
                depth -= 1
            yield i, c, depth, False
            if c in "([{":
                depth += 1
        i += 1


def _top_level_tokens(expr):
    """(start, end, token) of the depth-0 binary operators of interest:
    set operators (as words) and comparisons."""
    out = []
    chars = list(_scan(expr))
    k = 0
    while k < len(chars):
        i, c, depth, s = chars[k]
        if depth == 0 and not s:
            m = IDENT.match(expr, i) if (c.isalpha() or c == "_") else None
            if m and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
                w = m.group(0)
                if w in SET_OPS:
                    out.append((i, m.end(), w))
                k += len(w)
                continue
            for op in COMPARISONS:
                if expr.startswith(op, i):
                    out.append((i, i + len(op), op))
                    k += len(op)
                    break
            else:
                k += 1
            continue
        k += 1
    return out


def _skip_modifiers(expr, pos):
    """Position after `bool` and matching clauses (on(...), group_left(...))
    following a binary operator at pos."""
    while True:
        m = re.compile(r"\s*(bool|on|ignoring|group_left|group_right)\b\s*").match(expr, pos)
        if not m:
            return pos
        pos = m.end()
        if m.group(1) != "bool" and pos < len(expr) and expr[pos] == "(":
            depth = 0
            for j in range(pos, len(expr)):
                if expr[j] == "(":
                    depth += 1
                elif expr[j] == ")":
                    depth -= 1
                    if depth == 0:
                        pos = j + 1
                        break


def _strip_parens(e):
    e = e.strip()
    while e.startswith("(") and e.endswith(")"):
        depth, ok = 0, True
        for i, c, d, s in _scan(e):
            if not s and c == ")" and d == 0 and i != len(e) - 1:
                ok = False
                break
        if not ok:
            break
        e = e[1:-1].strip()
    return e


def alert_operands(expr):
    """The parts of an alert expression that must return data (see the
    module docstring): each top-level set-operator operand, with its
    top-level comparison removed, absent(X) as X."""
    expr = _strip_parens(expr)
    toks = _top_level_tokens(expr)
    operands, start = [], 0
    for a, b, t in toks:
        if t in SET_OPS:
            operands.append(expr[start:a])
            start = _skip_modifiers(expr, b)
    operands.append(expr[start:])
    out = []
    for op in operands:
        op = _strip_parens(op)
        cmp = [(a, b, t) for a, b, t in _top_level_tokens(op) if t in COMPARISONS]
        if cmp:
            op = _strip_parens(op[: cmp[0][0]])
        m = re.match(r"^(absent|absent_over_time)\s*\((.*)\)$", op, re.S)
        if m:
            op = _strip_parens(m.group(2))
        out.append(op.strip())
    return out


def metric_names(expr):
    """Metric names an expression selects (not functions, keywords, label
    names, durations or strings)."""
    names, depth_stack = set(), []
    chars = list(_scan(expr))
    k = 0
    skip_list_until = None
    while k < len(chars):
        i, c, depth, s = chars[k]
        if s:
            k += 1
            continue
        if c in "{[":
            depth_stack.append(c)
        elif c in "}]":
            if depth_stack:
                depth_stack.pop()
        if "{" in depth_stack or "[" in depth_stack:
            k += 1
            continue
        if (c.isalpha() or c == "_" or c == ":") and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:.$")):
            m = IDENT.match(expr, i)
            w = m.group(0)
            rest = expr[m.end():].lstrip()
            if w in LABEL_LIST_KW and rest.startswith("("):
                # skip the label list
                close = expr.index(")", m.end())
                k = next(n for n, ch in enumerate(chars) if ch[0] > close)
                continue
            if w.lower() not in KEYWORDS and not rest.startswith("("):
                names.add(w)
            k += len(w)
            continue
        k += 1
    return names


def substitute(expr, variables, rate_interval, interval):
    e = expr
    for k, v in (("__rate_interval", rate_interval), ("__interval", interval),
                 ("__range", interval)):
        e = e.replace("${%s}" % k, v).replace("$" + k, v)
    for name in sorted(variables, key=len, reverse=True):
        v = variables[name]
        e = e.replace("${%s}" % name, v).replace("${%s:regex}" % name, v).replace("$" + name, v)
    return e


# ------------------------------------------------------- Prometheus API


class Prom:
    def __init__(self, base):
        self.base = base

    def get(self, path, params=None, timeout=10):
        url = self.base + path
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
        d = json.loads(body)
        if d.get("status") != "success":
            raise RuntimeError("%s: %s" % (d.get("errorType"), d.get("error")))
        return d["data"]

    def query_range(self, q, start, end, step=1):
        return self.get("/api/v1/query_range", {"query": q, "start": start, "end": end, "step": step})["result"]

    def query(self, q, t=None):
        p = {"query": q}
        if t is not None:
            p["time"] = t
        return self.get("/api/v1/query", p)

    def series(self, match, start, end):
        return self.get("/api/v1/series", {"match[]": match, "start": start, "end": end})

    def label_values(self, label, match, start, end):
        return self.get("/api/v1/label/%s/values" % label, {"match[]": match, "start": start, "end": end})


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _pdeathsig():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop(proc, name, grace=10):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        print("check: %s did not stop in %d s: SIGKILL" % (name, grace), file=sys.stderr)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


# ------------------------------------------------- minimal gRPC client


class H2:
    """A minimal h2c (HTTP/2 without TLS, prior knowledge) unary gRPC
    client: literal HPACK headers, one call at a time; the response's
    headers are not decoded (a call succeeded when it returned a message)."""

    def __init__(self, addr, authority, token, timeout=5.0):
        host, port = addr.rsplit(":", 1)
        self.s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.authority, self.token, self.stream = authority, token, 1
        self.buf = b""
        self.s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        # SETTINGS: ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 2^31-1
        self._frame(0x4, 0, 0, struct.pack(">HI", 2, 0) + struct.pack(">HI", 4, 2 ** 31 - 1))
        self._frame(0x8, 0, 0, struct.pack(">I", 2 ** 31 - 1 - 65535))
        self.received = 0

    def _frame(self, typ, flags, stream, payload):
        self.s.sendall(struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", stream) + payload)

    def _read(self, n):
        while len(self.buf) < n:
            d = self.s.recv(65536)
            if not d:
                raise ConnectionError("connection closed")
            self.buf += d
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    @staticmethod
    def _int(v, prefix_bits, first=0):
        limit = (1 << prefix_bits) - 1
        if v < limit:
            return bytes([first | v])
        out = [first | limit]
        v -= limit
        while v >= 128:
            out.append((v & 127) | 128)
            v >>= 7
        out.append(v)
        return bytes(out)

    def _hdr(self, name, value):
        n, v = name.encode(), value.encode()
        return b"\x00" + self._int(len(n), 7) + n + self._int(len(v), 7) + v

    def call(self, path, message):
        sid = self.stream
        self.stream += 2
        block = b"".join(self._hdr(k, v) for k, v in [
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", self.authority), ("content-type", "application/grpc"),
            ("te", "trailers"), ("authorization", "Bearer " + self.token)])
        self._frame(0x1, 0x4, sid, block)  # HEADERS, END_HEADERS
        self._frame(0x0, 0x1, sid, b"\x00" + struct.pack(">I", len(message)) + message)  # DATA, END_STREAM
        data = b""
        while True:
            h = self._read(9)
            length = int.from_bytes(h[:3], "big")
            typ, flags, stream = h[3], h[4], struct.unpack(">I", h[5:9])[0] & 0x7FFFFFFF
            payload = self._read(length)
            if typ == 0x4 and not flags & 1:  # SETTINGS
                self._frame(0x4, 1, 0, b"")
            elif typ == 0x6 and not flags & 1:  # PING
                self._frame(0x6, 1, 0, payload)
            elif typ == 0x7:  # GOAWAY
                raise ConnectionError("GOAWAY")
            elif stream != sid:
                continue
            elif typ == 0x0:  # DATA
                if flags & 0x8:
                    payload = payload[1:len(payload) - payload[0]]
                data += payload
                self.received += length
                if self.received > 2 ** 30:
                    self._frame(0x8, 0, 0, struct.pack(">I", self.received))
                    self.received = 0
                if flags & 1:
                    break
            elif typ == 0x3:  # RST_STREAM
                return None
            elif typ == 0x1 and flags & 1:  # HEADERS with END_STREAM (trailers)
                break
        if len(data) < 5:
            return None  # no message: the call failed (grpc-status in the trailers)
        n = struct.unpack(">I", data[1:5])[0]
        return data[5:5 + n]

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass


def _varint(v):
    out = bytearray()
    while True:
        b = v & 127
        v >>= 7
        if v:
            out.append(b | 128)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(msg, i):
    """The varint at msg[i:]: (its value, the index after it)."""
    v, shift = 0, 0
    while True:
        b = msg[i]
        i += 1
        v |= (b & 127) << shift
        shift += 7
        if not b & 128:
            return v, i


def _field_bytes(msg, field):
    """The first length-delimited field `field` of a protobuf message."""
    i = 0
    while i < len(msg):
        key, i = _read_varint(msg, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            _, i = _read_varint(msg, i)
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        elif wt == 2:
            n, i = _read_varint(msg, i)
            if f == field:
                return msg[i:i + n]
            i += n
        else:
            return None
    return b""


def read_request(page):
    run = b"\x08" + _varint(page) + b"\x10" + _varint(1)
    return b"\x0a" + _varint(len(run)) + run


class ProxyReads(threading.Thread):
    def __init__(self, nodes, token, pages, rate, page_size=4096):
        super().__init__(daemon=True)
        self.nodes, self.token, self.pages, self.rate, self.ps = nodes, token, pages, rate, page_size
        self.ok = self.failed = self.wrong = self.timeouts = 0
        self.last_error = ""
        self.halt = threading.Event()

    def run(self):
        conns = {}
        k = 0
        while not self.halt.is_set():
            addr = self.nodes[k % len(self.nodes)]
            k += 1
            page = random.randrange(self.pages)
            t0 = time.time()
            try:
                c = conns.get(addr) or conns.setdefault(addr, H2(addr, addr, self.token))
                msg = c.call("/pagewire.v1.Node/Read", read_request(page))
                data = _field_bytes(msg, 1) if msg is not None else None
                if data is None:
                    self.failed += 1
                    self.last_error = "%s: Read of page %d returned no message" % (addr, page)
                elif len(data) != self.ps or struct.unpack("<Q", data[:8])[0] != page:
                    self.wrong += 1
                    self.last_error = "%s: page %d: %d bytes, header %r" % (addr, page, len(data), data[:8])
                else:
                    self.ok += 1
            except (OSError, ConnectionError) as e:
                self.failed += 1
                if isinstance(e, socket.timeout):
                    self.timeouts += 1
                self.last_error = "%s: Read of page %d: %s after %.1f s" % (addr, page, e, time.time() - t0)
                old = conns.pop(addr, None)
                if old:
                    old.close()
                self.halt.wait(0.2)
            self.halt.wait(1.0 / self.rate)
        for c in conns.values():
            c.close()


def provoke_rpc_error(coordinators, token):
    """One Undrain of a node id no cluster has: the coordinator refuses it
    (NotFound; Unavailable on a follower), which counts in rpc_errors."""
    msg = b"\x0a" + _varint(len(b"pagewire-monitoring-check-no-such-node")) + b"pagewire-monitoring-check-no-such-node"
    for addr in coordinators:
        try:
            c = H2(addr, addr, token)
            r = c.call("/pagewire.v1.Coordinator/Undrain", msg)
            c.close()
            print("check: Undrain of a node that does not exist on %s: %s" % (addr, "refused" if r is None else "accepted?!"))
        except (OSError, ConnectionError) as e:
            print("check: could not reach coordinator %s: %s" % (addr, e), file=sys.stderr)


# ------------------------------------------------------------- checks


def dashboard_queries(path):
    d = json.load(open(path))
    out = []

    def walk(panels):
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            for t in p.get("targets", []):
                if t.get("expr") and not t.get("hide"):
                    out.append(("%s [%s]" % (p.get("title", "?"), t.get("refId", "?")), t["expr"]))
            walk(p.get("panels", []))

    walk(d.get("panels", []))
    variables = [v for v in d.get("templating", {}).get("list", [])]
    return d, out, variables


def alert_rules(path):
    """(alert name, expr) of a rules file: a tiny reader for the layout
    promtool accepts here (`- alert:` then `expr:` plain, `>-` or `|`)."""
    rules, name, lines = [], None, open(path).read().splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = re.match(r"^\s*-\s*(alert|record):\s*(\S+)", ln)
        if m:
            name = m.group(2)
        m = re.match(r"^(\s*)expr:\s*(.*)$", ln)
        if m and name:
            ind, rest = len(m.group(1)), m.group(2).strip()
            if rest in (">-", ">", "|", "|-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > ind):
                    block.append(lines[i].strip())
                    i += 1
                expr = (" " if rest.startswith(">") else "\n").join(b for b in block if b)
                rules.append((name, expr))
                name = None
                continue
            if rest.startswith(("'", '"')):
                rest = rest[1:-1]
            rules.append((name, rest))
            name = None
        i += 1
    return rules


# The client library's series (client/src/metrics.rs, prefix pagewire_client):
# every family must have a series, and these must have moved in the window.
CLIENT_FAMILIES = [
    "pagewire_client_read_seconds_bucket", "pagewire_client_read_seconds_count",
    "pagewire_client_read_seconds_sum", "pagewire_client_reads_total",
    "pagewire_client_one_sided_total", "pagewire_client_fault_ins_total",
    "pagewire_client_grpc_reads_total", "pagewire_client_coalesced_total",
    "pagewire_client_writes_total", "pagewire_client_retries_total",
    "pagewire_client_reconnects_total", "pagewire_client_map_refreshes_total",
    "pagewire_client_lease_waits_total", "pagewire_client_unavailable_total",
]
CLIENT_MOVED = [
    # A read load through the client answers reads one-sidedly.
    'sum(increase(pagewire_client_read_seconds_count{path="one_sided"}[%s]))',
    'sum(increase(pagewire_client_one_sided_total[%s]))',
    'sum(increase(pagewire_client_reads_total[%s]))',
]


def client_checks(api, row, names, start, end):
    """The client series of --client targets: every family present, the
    read-latency histogram per path, the counters of a read load moved."""
    for n in CLIENT_FAMILIES:
        names.setdefault(n, "client series")
    window = "%ds" % max(1, int(end - start))
    for q in CLIENT_MOVED:
        q = q % window
        try:
            res = api.query(q, end)["result"]
            v = float(res[0]["value"][1]) if res else 0.0
            row("client", q, len(res), v > 0, "must be above 0", "%.4g" % v)
        except RuntimeError as e:
            row("client", q, 0, False, str(e)[:100])
    # Every path label the histogram has, with its observations in the window.
    q = 'sum by (path) (increase(pagewire_client_read_seconds_count[%s]))' % window
    try:
        res = api.query(q, end)["result"]
        paths = {r["metric"].get("path"): float(r["value"][1]) for r in res}
        row("client", q, len(res), {"one_sided", "fallback", "grpc", "coalesced"} <= set(paths),
            "every path present; " + ", ".join("%s %.0f" % kv for kv in sorted(paths.items())))
    except RuntimeError as e:
        row("client", q, 0, False, str(e)[:100])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--coordinator", action="append", default=[], metavar="HOST:PORT",
                    help="coordinator HTTP (metrics) port; repeat or comma-separate")
    ap.add_argument("--node", action="append", default=[], metavar="HOST:PORT",
                    help="node HTTP (metrics) port; repeat or comma-separate")
    ap.add_argument("--client", action="append", default=[], metavar="HOST:PORT",
                    help="a client's metrics port (e.g. `storm --metrics-listen`), scraped as job pagewire-client; "
                         "it comes up with the load, so it is waited for after the load starts")
    ap.add_argument("--dashboard", default=os.path.join(HERE, "pagewire-dashboard.json"))
    ap.add_argument("--rules", default=os.path.join(HERE, "alerts.yml"))
    ap.add_argument("--prometheus", default="/usr/bin/prometheus")
    ap.add_argument("--promtool", default="/usr/bin/promtool")
    ap.add_argument("--work-dir", default=None, help="parent of the temporary folder (default: system temp)")
    ap.add_argument("--up-timeout", type=float, default=60, help="seconds to wait for every target to be up")
    ap.add_argument("--load-seconds", type=float, default=20,
                    help="seconds of scraping under load before evaluating (the window range queries cover)")
    ap.add_argument("--load-cmd", default=None,
                    help="a shell command (a bounded read load) started once every target is up and stopped at the end")
    ap.add_argument("--load-wait", type=float, default=0,
                    help="after the evaluation, wait up to this many seconds for --load-cmd to end by itself "
                         "and fail unless it exits 0 (0: stop it at once)")
    ap.add_argument("--proxy-reads", action="append", default=[], metavar="HOST:PORT",
                    help="node gRPC ports: send single-page gRPC Reads round-robin to them during the load")
    ap.add_argument("--proxy-read-pages", type=int, default=1024, help="pages [0, N) the proxy reads pick from")
    ap.add_argument("--proxy-read-rate", type=float, default=10, help="proxy reads per second")
    ap.add_argument("--provoke-rpc-error", action="append", default=[], metavar="HOST:PORT",
                    help="coordinator gRPC port: send one Undrain of a node that does not exist")
    ap.add_argument("--token-file", default=None, help="the cluster token (for --proxy-reads, --provoke-rpc-error)")
    ap.add_argument("--timeout", type=int, default=600, help="give up (and clean up) after this many seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (Prometheus' config and log)")
    a = ap.parse_args()

    split = lambda xs: [t for x in xs for t in x.split(",") if t.strip()]
    coords, nodes, clients = split(a.coordinator), split(a.node), split(a.client)
    proxies, provoke = split(a.proxy_reads), split(a.provoke_rpc_error)
    if not coords and not nodes:
        ap.error("give --coordinator and/or --node scrape targets")
    token = None
    if proxies or provoke:
        if not a.token_file:
            ap.error("--proxy-reads and --provoke-rpc-error need --token-file")
        token = open(a.token_file).read().strip()
    for b in (a.prometheus, a.promtool):
        if not os.access(b, os.X_OK):
            ap.error("%s not found (Debian: apt-get install prometheus)" % b)

    rows, failed = [], [0]

    def row(kind, what, series, ok, note="", last=""):
        rows.append((kind, what, series, ok, note, last))
        if not ok:
            failed[0] += 1

    # promtool
    pt = subprocess.run([a.promtool, "check", "rules", a.rules], capture_output=True, text=True)
    row("promtool", "check rules " + os.path.basename(a.rules), "-", pt.returncode == 0,
        (pt.stdout + pt.stderr).strip().splitlines()[-1] if (pt.stdout + pt.stderr).strip() else "")

    dash, panel_queries, variables = dashboard_queries(a.dashboard)
    rules = alert_rules(a.rules)
    # The small YAML reader above must have found every rule promtool found.
    m = re.search(r"SUCCESS: (\d+) rules found", pt.stdout)
    if m:
        row("rules", "alert/record rules read from " + os.path.basename(a.rules), len(rules),
            int(m.group(1)) == len(rules), "promtool found %s" % m.group(1))

    tmp = tempfile.mkdtemp(prefix="pagewire-promcheck-", dir=a.work_dir)
    prom = load = proxy = None

    def on_signal(sig, _frame):
        raise SystemExit("check: signal %d: stopping" % sig)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGALRM, lambda s, f: (_ for _ in ()).throw(SystemExit("check: --timeout %d s ran out" % a.timeout)))
    signal.alarm(a.timeout)
    try:
        port = free_port()
        cfg = os.path.join(tmp, "prometheus.yml")
        jobs = []
        if coords:
            jobs.append(("pagewire-coordinator", coords))
        if nodes:
            jobs.append(("pagewire-node", nodes))
        if clients:
            jobs.append(("pagewire-client", clients))
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n")
            f.write("rule_files:\n  - %s\n" % json.dumps(os.path.abspath(a.rules)))
            f.write("scrape_configs:\n")
            for job, targets in jobs:
                f.write("  - job_name: %s\n    static_configs:\n      - targets: %s\n" % (job, json.dumps(targets)))
        log = open(os.path.join(tmp, "prometheus.log"), "w")
        prom = subprocess.Popen(
            [a.prometheus, "--config.file=" + cfg, "--storage.tsdb.path=" + os.path.join(tmp, "data"),
             "--web.listen-address=127.0.0.1:%d" % port, "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_pdeathsig)
        api = Prom("http://127.0.0.1:%d" % port)
        print("check: prometheus on 127.0.0.1:%d (pid %d), config %s" % (port, prom.pid, cfg))
        t0 = time.time()
        while True:
            if prom.poll() is not None:
                raise SystemExit("check: prometheus exited (%s): %s" % (prom.returncode, open(log.name).read()[-2000:]))
            try:
                with urllib.request.urlopen(api.base + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.time() - t0 > 30:
                raise SystemExit("check: prometheus not ready in 30 s")
            time.sleep(0.3)

        want = len(coords) + len(nodes)
        t0 = time.time()
        # The clients' endpoints come up with the load: waited for below.
        servers = lambda ts: [t for t in ts if t["labels"].get("job") != "pagewire-client"]
        while True:
            targets = servers(api.get("/api/v1/targets", {"state": "active"})["activeTargets"])
            up = [t for t in targets if t["health"] == "up"]
            if len(up) == want:
                break
            if time.time() - t0 > a.up_timeout:
                for t in targets:
                    row("target", "%s %s" % (t["labels"].get("job"), t["scrapeUrl"]), "-", t["health"] == "up",
                        t.get("lastError", ""))
                raise SystemExit("check: not every target up within %.0f s" % a.up_timeout)
            time.sleep(0.5)
        for t in targets:
            row("target", "%s %s" % (t["labels"].get("job"), t["scrapeUrl"]), "-", True, "up after %.1f s" % (time.time() - t0))

        load_start = time.time()
        if a.load_cmd:
            print("check: load: %s" % a.load_cmd)
            load = subprocess.Popen(a.load_cmd, shell=True, start_new_session=True, preexec_fn=_pdeathsig)
        if provoke:
            provoke_rpc_error(provoke, token)
        if proxies:
            proxy = ProxyReads(proxies, token, a.proxy_read_pages, a.proxy_read_rate)
            proxy.start()
        print("check: scraping under load for %.0f s" % a.load_seconds)
        deadline = load_start + a.load_seconds
        if clients:
            # Up within half the load window, so the window holds enough
            # of their samples for a rate.
            while True:
                ts = [t for t in api.get("/api/v1/targets", {"state": "active"})["activeTargets"]
                      if t["labels"].get("job") == "pagewire-client"]
                if len([t for t in ts if t["health"] == "up"]) == len(clients) or \
                        time.time() > load_start + a.load_seconds / 2:
                    break
                time.sleep(0.5)
            for t in ts:
                row("target", "%s %s" % (t["labels"].get("job"), t["scrapeUrl"]), "-", t["health"] == "up",
                    "up %.1f s after the load started" % (time.time() - load_start) if t["health"] == "up"
                    else "not up %.0f s after the load started: %s" % (time.time() - load_start, t.get("lastError", "")))
        while time.time() < deadline:
            if load is not None and load.poll() is not None and load.returncode != 0:
                print("check: load command exited with %d" % load.returncode, file=sys.stderr)
            time.sleep(0.5)
        if proxy:
            # A refused read (a map change, a lease) is counted; a read with
            # no answer in 5 s (a node that hangs) or a wrong page fails.
            row("load", "proxy gRPC Reads via %s" % ",".join(proxies), proxy.ok,
                proxy.ok > 0 and proxy.wrong == 0 and proxy.timeouts == 0,
                "%d ok, %d failed (%d timed out), %d wrong%s" % (
                    proxy.ok, proxy.failed, proxy.timeouts, proxy.wrong,
                    ("; last: " + proxy.last_error) if proxy.last_error else ""))
        if load is not None and load.poll() is not None and load.returncode != 0:
            row("load", "load command", "-", False, "exited %d before the evaluation" % load.returncode)
            load_failed = True
        else:
            load_failed = False

        # The window: from the load's start (the evaluation runs while it goes on).
        end = time.time()
        start = load_start
        scrape = 1
        rate_interval = "%ds" % (4 * scrape)
        interval = "%ds" % scrape

        # Variables.
        var_values = {}
        for v in variables:
            name = v.get("name")
            if v.get("type") == "datasource":
                var_values[name] = "prometheus"
                continue
            if v.get("type") != "query":
                var_values[name] = str(v.get("current", {}).get("value", ""))
                continue
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.match(r"^\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", q or "")
            vals = []
            try:
                if m:
                    vals = api.label_values(m.group(2), m.group(1), start, end)
                elif re.match(r"^\s*label_values\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", q or ""):
                    vals = api.label_values(re.match(r"^\s*label_values\(\s*(\w+)", q).group(1), "{__name__=~\".+\"}", start, end)
                else:
                    vals = []
                    raise RuntimeError("unsupported variable query")
                row("variable", "$%s = %s" % (name, q), len(vals), len(vals) > 0, ",".join(vals)[:60])
            except RuntimeError as e:
                row("variable", "$%s = %s" % (name, q), 0, False, str(e)[:80])
            if v.get("includeAll") or v.get("multi"):
                var_values[name] = v.get("allValue") or "(%s)" % "|".join(re.escape(x) for x in vals)
            else:
                var_values[name] = vals[0] if vals else ""

        names = {}

        def data_check(kind, label, expr):
            q = substitute(expr, var_values, rate_interval, interval)
            for n in metric_names(q):
                names.setdefault(n, label)
            try:
                res = api.query_range(q, start, end)
            except RuntimeError as e:
                row(kind, q, 0, False, str(e)[:100])
                return
            finite = lambda v: v[1] not in ("NaN", "+Inf", "-Inf")
            numbers = sum(1 for s in res if any(finite(v) for v in s["values"]))
            note = "" if numbers == len(res) else "%d of %d series NaN throughout" % (len(res) - numbers, len(res))
            lasts = [float(next(v for v in reversed(s["values"]) if finite(v))[1])
                     for s in res if any(finite(v) for v in s["values"])]
            if not lasts:
                last = "-"
            elif min(lasts) == max(lasts):
                last = "%.4g" % lasts[0]
            else:
                last = "%.4g..%.4g" % (min(lasts), max(lasts))
            row(kind, q, len(res), numbers > 0, note or label, last)

        for label, expr in panel_queries:
            data_check("panel", label, expr)
        if clients:
            client_checks(api, row, names, start, end)
        for name, expr in rules:
            try:
                res = api.query(expr)["result"]
                row("alert", "%s: %s" % (name, expr), len(res), True, "firing now" if res else "as written: evaluates, silent")
            except RuntimeError as e:
                row("alert", "%s: %s" % (name, expr), 0, False, str(e)[:100])
            for op in alert_operands(expr):
                data_check("alert-lhs", name, op)
            for n in metric_names(expr):
                names.setdefault(n, name)
        # Every target still up at the end of the evaluation (a process that
        # hung under the load stops answering /metrics); before the wait for
        # the load, whose end takes the clients' endpoints with it.
        for t in api.get("/api/v1/targets", {"state": "active"})["activeTargets"]:
            row("target", "%s %s" % (t["labels"].get("job"), t["scrapeUrl"]), "-", t["health"] == "up",
                "at the end: %s%s" % (t["health"], (", " + t["lastError"]) if t.get("lastError") else ""))
        if load is not None and a.load_wait > 0 and not load_failed:
            try:
                rc = load.wait(a.load_wait)
                row("load", "load command", "-", rc == 0, "exited %d after the evaluation" % rc)
            except subprocess.TimeoutExpired:
                row("load", "load command", "-", False, "still running %.0f s after the evaluation" % a.load_wait)
        for n in sorted(names):
            try:
                s = api.series(n, start, end)
                row("metric", n, len(s), len(s) > 0, "used by " + names[n])
            except RuntimeError as e:
                row("metric", n, 0, False, str(e)[:100])
    finally:
        signal.alarm(0)
        if proxy:
            proxy.halt.set()
            proxy.join(5)
        stop(load, "load command")
        stop(prom, "prometheus")
        if a.keep:
            print("check: kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if rows:
            print("\n%-9s  %6s  %-4s  %10s  %s" % ("check", "series", "", "last", "query  (note)"))
            for kind, what, series, ok, note, last in rows:
                print("%-9s  %6s  %-4s  %10s  %s%s" % (kind, series, "ok" if ok else "FAIL", last or "",
                                                      what.replace("\n", " "), "  (%s)" % note if note else ""))
            print("\n%d checks, %d failed" % (len(rows), failed[0]))
    return 1 if failed[0] else 0


if __name__ == "__main__":
    sys.exit(main())
