#!/usr/bin/env python3
"""Signs a webhook delivery the way its sender does, for services/gateway/tests/webhooks.rs.

    sign.py SCHEME SECRET ID TIMESTAMP < body      prints the headers as a JSON object

standard-webhooks: the specification's own library (PyPI `standardwebhooks`), as a
provider that follows it signs. stripe: HMAC-SHA256 of "{t}.{body}" keyed by the secret
as written, hex, in `Stripe-Signature: t=…,v1=…` (Stripe's "verify manually" docs); the
key is the body's "id", so ID is unused. github: HMAC-SHA256 of the body, hex, in
`X-Hub-Signature-256: sha256=…` (GitHub's "validating deliveries" docs), ID in
`X-GitHub-Delivery`; no timestamp is signed.
"""
import datetime
import hashlib
import hmac
import json
import sys

scheme, secret, msg_id, timestamp = sys.argv[1:5]
body = sys.stdin.buffer.read()
if scheme == "standard-webhooks":
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError:
        sys.exit("sign.py: the Standard Webhooks library is missing: pip install standardwebhooks")
    at = datetime.datetime.fromtimestamp(int(timestamp), tz=datetime.timezone.utc)
    signature = Webhook(secret).sign(msg_id, at, body.decode())
    headers = {"webhook-id": msg_id, "webhook-timestamp": timestamp, "webhook-signature": signature}
elif scheme == "stripe":
    v1 = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    headers = {"Stripe-Signature": f"t={timestamp},v1={v1}"}
elif scheme == "github":
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    headers = {"X-Hub-Signature-256": f"sha256={digest}", "X-GitHub-Delivery": msg_id}
else:
    sys.exit(f"sign.py: unknown scheme {scheme}")
print(json.dumps(headers))
