#!/usr/bin/env python3
"""A settlement-callback receiver as a tenant writes one: every delivery is verified with
the Standard Webhooks library (PyPI `standardwebhooks`, the specification's own), then
appended to a file as one JSON line {"id", "body"} and answered 204; a delivery that does
not verify is appended as {"refused": why} and answered 400.

    receiver.py PORT SECRET OUT_FILE

Prints "receiver listening" once it listens on 127.0.0.1:PORT.
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    from standardwebhooks.webhooks import Webhook
except ImportError:
    sys.exit("receiver.py: the Standard Webhooks library is missing: pip install standardwebhooks")

port, secret, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
webhook = Webhook(secret)


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        try:
            webhook.verify(body, dict(self.headers.items()))
            line = {"id": self.headers["webhook-id"], "body": json.loads(body)}
            status = 204
        except Exception as e:  # the library's WebhookVerificationError, or bad JSON
            line = {"refused": repr(e)}
            status = 400
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Receiver)
print("receiver listening", flush=True)
server.serve_forever()
