#!/usr/bin/env python3
"""The adversarial client of loadtest/bench: one tenant doing its worst within the limits.

    attacker.py serve-big PORT                 the attacker's upstream: /sink reads the body and
                                               answers 201 {}; /big6 gets 6 MiB; /slow answers
                                               201 {} after 8 s; anything else gets 4 MiB
    attacker.py attack URL TOKEN SECONDS       worst-case load on a gateway, for SECONDS
    attacker.py cpu URL TOKEN PID [N]          gateway CPU per worst-case 1 MiB body
    attacker.py replays URL TOKEN N            one 6 MiB answer stored, then N retries of it at once
    attacker.py non-readers URL TOKEN N SECS   N retries of it that never read, for SECS
    attacker.py hung-up URL TOKEN OTHER SECS   a held key, then SECS of retries with
                                               `Prefer: wait=5` that hang up at once, while
                                               another tenant (token OTHER) pays with new keys

`attack` is one client that sends, one after another on one connection until SECONDS
have passed, 1 MiB JSON objects of 86,000 members and 1 MiB bodies of objects nested 100 deep (POSTed to /sink, whose upstream
does not parse them: the gateway's fingerprint is what they cost) and POSTs to /big,
whose upstream answers 4 MiB (stored and cached: under the route's max_response_bytes);
beside them, 200 connections trickle a request head and never finish it (reopened when
the gateway closes them). It prints one JSON line: what it sent and what came back.
`cpu` sends N (default 20) bodies of each shape one after another, and prints the gateway
process's CPU milliseconds per request for each (a flat 1 MiB string for comparison).
Traffic goes to the URL given (127.0.0.1) only, and everything stops by itself.
"""
import http.client
import http.server
import json
import os
import socket
import socketserver
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid

BODY_LIMIT = 1024 * 1024


def members_body():
    # {"0000000":0,"0000001":0,...}: 86,000 distinct names, just under 1 MiB.
    return ("{" + ",".join(f'"{i:07}":0' for i in range(86_000)) + "}").encode()


def deep_body():
    # [{"a":{"a":...100 deep...}}, ...]: as many as fit in 1 MiB.
    one = '{"a":' * 100 + "0" + "}" * 100
    return ("[" + ",".join([one] * ((BODY_LIMIT - 2) // (len(one) + 1))) + "]").encode()


def flat_body():
    return ('{"orderId":"' + "x" * (BODY_LIMIT - 64) + '","amountUah":1}').encode()


class Client:
    """One keep-alive connection, reopened after an error."""

    def __init__(self, url, token):
        self.url = urllib.parse.urlsplit(url)
        self.token = token
        self.conn = None

    def post(self, path, body, timeout=30):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=timeout)
        try:
            self.conn.request("POST", path, body=body, headers={
                "Authorization": f"Bearer {self.token}",
                "Idempotency-Key": f"attack-{uuid.uuid4()}",
                "Content-Type": "application/json",
            })
            response = self.conn.getresponse()
            size = len(response.read())
            if response.getheader("connection", "").lower() == "close":
                self.close()
            return response.status, size
        except (OSError, http.client.HTTPException):
            self.close()
            return "error", 0

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def serve_big(port):
    body = bytes(i % 251 for i in range(4 * 1024 * 1024))
    body6 = bytes(i % 251 for i in range(6 * 1024 * 1024))

    class Big(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path == "/slow":
                time.sleep(8)
            answer = {"/sink": b"{}", "/slow": b"{}", "/big6": body6}.get(self.path, body)
            self.send_response(201)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_GET = do_POST

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    Server(("127.0.0.1", port), Big).serve_forever()


def attack(url, token, seconds):
    deadline = time.monotonic() + seconds
    tally, lock = {}, threading.Lock()

    def count(kind, outcome):
        with lock:
            tally.setdefault(kind, {}).setdefault(str(outcome), 0)
            tally[kind][str(outcome)] += 1

    def bodies(kinds):
        client = Client(url, token)
        while time.monotonic() < deadline:
            for kind, path, body in kinds:
                status, _ = client.post(path, body)
                count(kind, status)
        client.close()

    def slow_heads(n=200):
        target = urllib.parse.urlsplit(url)
        socks = []

        def opened():
            s = socket.create_connection((target.hostname, target.port), timeout=5)
            s.setblocking(False)
            s.send(b"POST /payments HTTP/1.1\r\nHost: x\r\n")
            count("slow_heads", "opened")
            return s

        socks = [opened() for _ in range(n)]
        while time.monotonic() < deadline:
            for i, s in enumerate(socks):
                try:
                    s.send(b"x")  # never a full header line
                    if s.recv(1) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    count("slow_heads", "closed by the gateway")
                    socks[i] = opened()
            time.sleep(1)
        for s in socks:
            s.close()

    # One client: one connection sending the three kinds of request back to back, as
    # fast as the gateway answers, beside the slow heads.
    threads = [
        threading.Thread(target=bodies, args=([("members_86k", "/sink", members_body()),
                                               ("nested_100", "/sink", deep_body()),
                                               ("response_4mib", "/big", b"{}")],)),
        threading.Thread(target=slow_heads),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(tally))


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu(url, token, pid, n):
    client = Client(url, token)
    out = {}
    for name, body in [("members_86k", members_body()), ("nested_100", deep_body()), ("flat_string", flat_body())]:
        client.post("/sink", body)  # warm the connection and the pools
        before = cpu_seconds(pid)
        statuses = {client.post("/sink", body)[0] for _ in range(n)}
        out[name] = {"gateway_cpu_ms": (cpu_seconds(pid) - before) / n * 1000, "bytes": len(body),
                     "statuses": sorted(map(str, statuses))}
    client.close()
    print(json.dumps(out))


def request_bytes(url, token, path, key, extra=""):
    return (f"POST {path} HTTP/1.1\r\nHost: {urllib.parse.urlsplit(url).netloc}\r\n"
            f"Authorization: Bearer {token}\r\nIdempotency-Key: {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 2\r\n{extra}\r\n{{}}").encode()


def replays(url, token, n):
    """Stores one 6 MiB answer, then sends n retries of it at once, each read whole."""
    key = f"storm-{uuid.uuid4()}"
    status, size = post_key(Client(url, token), "/big6", key)
    results, lock = [], threading.Lock()
    start = threading.Barrier(n)

    def one():
        client = Client(url, token)
        start.wait()
        got = post_key(client, "/big6", key, timeout=60)
        client.close()
        with lock:
            results.append(got)

    threads = [threading.Thread(target=one) for _ in range(n)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = {}
    for status_, size_ in results:
        statuses[str(status_)] = statuses.get(str(status_), 0) + 1
    print(json.dumps({"first": [status, size], "retries": n, "statuses": statuses,
                      "whole": sum(1 for s, b in results if s == 201 and b == size),
                      "seconds": round(time.monotonic() - began, 2)}))


def post_key(client, path, key, timeout=30, body=b"{}"):
    if client.conn is None:
        client.conn = http.client.HTTPConnection(client.url.hostname, client.url.port, timeout=timeout)
    try:
        client.conn.request("POST", path, body=body, headers={
            "Authorization": f"Bearer {client.token}", "Idempotency-Key": key,
            "Content-Type": "application/json"})
        response = client.conn.getresponse()
        return response.status, len(response.read())
    except (OSError, http.client.HTTPException):
        client.close()
        return "error", 0


def non_readers(url, token, n, seconds):
    """Stores one 6 MiB answer, then n clients ask for it and read nothing for `seconds`."""
    key = f"stall-{uuid.uuid4()}"
    status, size = post_key(Client(url, token), "/big6", key)
    target = urllib.parse.urlsplit(url)
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        s.connect((target.hostname, target.port))
        s.sendall(request_bytes(url, token, "/big6", key))
        socks.append(s)
    time.sleep(seconds)
    # What each got: cut off by the gateway (closed before the whole answer), the whole
    # answer, or still open.
    outcome = {"cut_off": 0, "whole": 0, "still_open": 0}
    for s in socks:
        s.settimeout(2)
        got, closed = 0, False
        try:
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    closed = True
                    break
                got += len(chunk)
        except socket.timeout:
            pass
        except OSError:
            closed = True
        if got >= size:
            outcome["whole"] += 1
        elif closed:
            outcome["cut_off"] += 1
        else:
            outcome["still_open"] += 1
        s.close()
    print(json.dumps({"first": [status, size], "clients": n, "held_seconds": seconds, **outcome}))


def metric(url, name):
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
    except OSError:
        pass
    return None


def hung_up(url, token, other_token, seconds):
    """A held key (its upstream answers after 8 s); retries of it with `Prefer: wait=5`
    that reset their connection at once, as fast as one client can; beside them another
    tenant pays with new keys. Prints what the gateway held and served."""
    key = f"held-{uuid.uuid4()}"
    holder = threading.Thread(target=lambda: post_key(Client(url, token), "/slow", key, timeout=30))
    holder.start()
    time.sleep(0.5)
    target = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + seconds
    sent = [0]
    in_flight = []
    served = {}
    statements_before = metric(url, "idemgate_ledger_statements_total") or 0

    def flood():
        request = request_bytes(url, token, "/slow", key, "Prefer: wait=5\r\n")
        while time.monotonic() < deadline:
            try:
                s = socket.create_connection((target.hostname, target.port), timeout=5)
                s.sendall(request)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
                sent[0] += 1
            except OSError:
                pass

    def other():
        client = Client(url, other_token)
        while time.monotonic() < deadline:
            status, _ = post_key(client, "/payments", f"other-{uuid.uuid4()}",
                                 body=b'{"orderId": "other", "amountUah": 100}')
            served[str(status)] = served.get(str(status), 0) + 1
        client.close()

    def watch():
        while time.monotonic() < deadline + 1:
            value = metric(url, "idemgate_requests_in_flight")
            if value is not None:
                in_flight.append(value)
            time.sleep(0.1)

    threads = [threading.Thread(target=f) for f in (flood, flood, other, watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statements = (metric(url, "idemgate_ledger_statements_total") or 0) - statements_before
    holder.join()
    print(json.dumps({"hung_up_retries": sent[0], "seconds": seconds,
                      "max_requests_in_flight": max(in_flight) if in_flight else None,
                      "ledger_statements": statements, "other_tenant": served}))


if __name__ == "__main__":
    verb, args = sys.argv[1], sys.argv[2:]
    if verb == "serve-big":
        serve_big(int(args[0]))
    elif verb == "attack":
        attack(args[0], args[1], float(args[2]))
    elif verb == "replays":
        replays(args[0], args[1], int(args[2]))
    elif verb == "non-readers":
        non_readers(args[0], args[1], int(args[2]), float(args[3]))
    elif verb == "hung-up":
        hung_up(args[0], args[1], args[2], float(args[3]))
    elif verb == "cpu":
        cpu(args[0], args[1], int(args[2]), int(args[3]) if len(args) > 3 else 20)
    else:
        sys.exit(__doc__)
