#!/usr/bin/env python3
"""Tests of the Helm chart, without a cluster or a helm binary.

Renders helm/idemgate with helm-python-sdk (Helm's own Go SDK) for the default values and
for ci/production-values.yaml, lints it, validates every rendered manifest against the
Kubernetes 1.30 schemas offline (kubernetes-validate), asserts the objects and security
settings platform teams expect, and runs `idemgate check-config` on the rendered config
with the environment the Deployment gives it, so the chart can never render a config the
binary rejects. The alert rules (idemgate/files/alerts.yaml) pass `promtool check rules` and
`promtool test rules helm/alerts_test.yaml`, and the PrometheusRule carries exactly them.

Usage: python3 helm/test_chart.py [path/to/idemgate binary]
"""

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import unittest
from pathlib import Path

import yaml
import helm_python as helm

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "idemgate"
KUBE = "1.30.0"
BINARY = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("IDEMGATE_BIN", ROOT / "target" / "debug" / "idemgate"))


LIMITS = {
    "server": {"max_body_bytes": 1048576, "max_header_bytes": 16384, "max_headers": 100,
               "header_read_timeout": "10s", "body_read_timeout": "30s", "max_concurrent_requests": 1024,
               "response_write_timeout": "30s"},
    "redis": {"local_cache_bytes": 64 * 1024 * 1024},
    "route": {"max_response_bytes": 10 * 1024 * 1024},
}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    files = chart.render(values, name="demo", namespace="payments", is_install=True)
    docs = []
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def production_values() -> dict:
    return yaml.safe_load((CHART / "ci" / "production-values.yaml").read_text())


def by_kind(docs, kind, name_suffix=""):
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def env_map(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


class ChartTest(unittest.TestCase):
    cases = {"default": {}, "production": production_values(),
             "oidc": {"auth": {"mode": "oidc", "oidcIssuer": "https://idp.example.com/realms/acme",
                               "audience": "payments-api"}},
             "tenants": {"config": {"tenants": {"default": {"rate": "500/s", "max_concurrent_requests": 256},
                                                "acme": {"ttl": "72h", "lease": "1m"}}}},
             "admin": {"admin": {"enabled": True, "tokenSecret": "idemgate-admin"}},
             "webhooks": {"webhooks": {"secrets": {"stripe": "idemgate-stripe", "billing": "idemgate-billing"}},
                          "config": {"routes": [{"method": "POST", "path": "/webhooks/stripe",
                                                 "upstream": "http://billing.default.svc.cluster.local:9090",
                                                 "idempotent": True,
                                                 "webhook": {"scheme": "stripe", "tenant": "acme",
                                                             "secret_file": "/etc/idemgate/webhooks/stripe/secret"}},
                                                {"method": "POST", "path": "/webhooks/{tenant}/billing",
                                                 "upstream": "http://billing.default.svc.cluster.local:9090",
                                                 "idempotent": True, "probe": "GET /events/{key}",
                                                 "webhook": {"scheme": "standard-webhooks",
                                                             "secret_dir": "/etc/idemgate/webhooks/billing",
                                                             "max_unverified": 32}}]}},
             "callbacks": {"callbacks": {"secrets": {"acme": "idemgate-acme-callbacks"}},
                           "config": {"tenants": {"acme": {
                               "callback_url": "https://hooks.acme.example/idemgate",
                               "callback_secret_file": "/etc/idemgate/callbacks/acme/secret"}}}}}

    def test_a_tenants_callback_secret_is_mounted_where_its_entry_names_it(self):
        docs = render(self.cases["callbacks"])
        config = tomllib.loads(by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual(config["tenants"]["acme"]["callback_secret_file"], "/etc/idemgate/callbacks/acme/secret")
        pod = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.assertEqual(mounts["callback-acme"]["mountPath"], "/etc/idemgate/callbacks/acme")
        self.assertEqual(volumes["callback-acme"]["secret"]["secretName"], "idemgate-acme-callbacks")

    def test_webhook_routes_are_rendered_with_their_secrets_mounted(self):
        docs = render(self.cases["webhooks"])
        config = tomllib.loads(by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual(config["routes"][0]["webhook"],
                         {"scheme": "stripe", "tenant": "acme", "secret_file": "/etc/idemgate/webhooks/stripe/secret"})
        pod = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        # One Secret per route, each in a directory of its own: no file is read by two schemes.
        for name, secret in [("stripe", "idemgate-stripe"), ("billing", "idemgate-billing")]:
            self.assertEqual(mounts[f"webhook-{name}"]["mountPath"], f"/etc/idemgate/webhooks/{name}")
            self.assertEqual(volumes[f"webhook-{name}"]["secret"]["secretName"], secret)
        self.assertNotIn("webhook-secrets", volumes)
        # The older form: one Secret mounted whole.
        pod = by_kind(render({"webhooks": {"secret": "idemgate-webhooks"}}), "Deployment",
                      "idemgate")[0]["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        self.assertEqual(mounts["webhook-secrets"]["mountPath"], "/etc/idemgate/webhooks")
        # Without either nothing is mounted.
        pod = by_kind(render({}), "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        self.assertFalse([v for v in pod["volumes"] if v["name"].startswith("webhook")])

    def test_lint_is_clean(self):
        for name, values in self.cases.items():
            result = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE}")
            errors = [m for m in result.get("messages", []) if m.get("severity", 0) >= 3] + result.get("errors", [])
            self.assertEqual(errors, [], f"{name}: {result}")

    def test_manifests_validate_against_kubernetes_schemas(self):
        for name, values in self.cases.items():
            docs = [d for d in render(values) if d["apiVersion"] != "monitoring.coreos.com/v1"]
            with tempfile.TemporaryDirectory() as tmp:
                paths = []
                for i, doc in enumerate(docs):
                    path = Path(tmp) / f"{i:02d}-{doc['kind']}.yaml"
                    path.write_text(yaml.safe_dump(doc))
                    paths.append(str(path))
                run = subprocess.run(
                    ["kubernetes-validate", "--strict", "-k", KUBE, *paths], capture_output=True, text=True
                )
                self.assertEqual(run.returncode, 0, f"{name}:\n{run.stdout}\n{run.stderr}")

    def test_expected_objects_are_rendered(self):
        docs = render({})
        kinds = sorted({d["kind"] for d in docs})
        for kind in ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "PodDisruptionBudget",
                     "Service", "ServiceAccount"]:
            self.assertIn(kind, kinds)
        self.assertEqual(len(by_kind(docs, "Deployment")), 2, "the gateway and the reconciler")
        self.assertEqual(by_kind(docs, "ServiceMonitor") + by_kind(docs, "NetworkPolicy"), [], "optional, off by default")
        prod = render(production_values())
        self.assertEqual(len(by_kind(prod, "ServiceMonitor")), 1)
        self.assertEqual(by_kind(docs, "PrometheusRule"), [], "optional, off by default")
        self.assertEqual(len(by_kind(prod, "PrometheusRule")), 1)
        self.assertEqual(len(by_kind(prod, "NetworkPolicy")), 1)
        self.assertEqual(prod[0]["metadata"]["name"].split("-")[0], "payments", "fullnameOverride applies")

    def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook(self):
        job = by_kind(render({}), "Job")[0]
        hooks = job["metadata"]["annotations"]["helm.sh/hook"].split(",")
        self.assertEqual(sorted(hooks), ["pre-install", "pre-upgrade"])
        self.assertEqual(job["spec"]["template"]["spec"]["containers"][0]["args"][0], "migrate")

    def test_pods_are_locked_down_and_probed(self):
        for name, values in self.cases.items():
            docs = render(values)
            for workload in by_kind(docs, "Deployment") + by_kind(docs, "Job"):
                pod = workload["spec"]["template"]["spec"]
                self.assertTrue(pod["securityContext"]["runAsNonRoot"], name)
                for c in pod["containers"]:
                    sc = c["securityContext"]
                    self.assertFalse(sc["allowPrivilegeEscalation"], f"{name} {c['name']}")
                    self.assertTrue(sc["readOnlyRootFilesystem"], f"{name} {c['name']}")
                    self.assertEqual(sc["capabilities"]["drop"], ["ALL"], f"{name} {c['name']}")
                    self.assertIn("resources", c)
            gateway = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]["containers"][0]
            self.assertEqual(gateway["livenessProbe"]["httpGet"]["path"], "/healthz")
            self.assertEqual(gateway["readinessProbe"]["httpGet"]["path"], "/readyz")

    def test_secrets_are_referenced_never_inlined(self):
        values = production_values()
        docs = render(values)
        self.assertEqual(by_kind(docs, "Secret"), [], "an existing Secret is used, none created")
        config = by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"]
        for word in ["postgres://", "redis://", "hs256_secret =", "password"]:
            self.assertNotIn(word, config)
        gateway = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        env = env_map(gateway["containers"][0])
        for var in ["IDEMGATE_POSTGRES__URL", "IDEMGATE_REDIS__URL"]:
            self.assertEqual(env[var]["valueFrom"]["secretKeyRef"]["name"], "idemgate-prod", var)
        self.assertEqual([v["secret"]["secretName"] for v in gateway["volumes"] if "secret" in v], ["idemgate-jwks"])
        # Development: a Secret created from values, as a hook so the migrations find it.
        dev = render({"secrets": {"create": True, "values": {
            "postgresUrl": "postgres://u:p@db/idemgate", "redisUrl": "redis://r:6379", "jwtHs256Secret": "dev-secret-123"}}})
        secret = by_kind(dev, "Secret")[0]
        self.assertIn("pre-install", secret["metadata"]["annotations"]["helm.sh/hook"])

    def test_config_and_secret_changes_roll_the_pods(self):
        def checksum(values):
            pod = by_kind(render(values), "Deployment", "idemgate")[0]["spec"]["template"]["metadata"]
            return pod["annotations"]["checksum/config"]
        before = checksum({})
        after = checksum({"config": {"idempotency": {"ttl": "12h"}}})
        self.assertNotEqual(before, after)

    def test_labels_image_tag_and_otlp(self):
        docs = render({"otel": {"endpoint": "http://collector:4318"}})
        deploy = by_kind(docs, "Deployment", "idemgate")[0]
        labels = deploy["metadata"]["labels"]
        for key in ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"]:
            self.assertIn(key, labels)
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        container = deploy["spec"]["template"]["spec"]["containers"][0]
        self.assertTrue(container["image"].endswith(":" + chart["appVersion"]), "image.tag defaults to appVersion")
        self.assertEqual(env_map(container)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"], "http://collector:4318")

    def test_schema_rejects_bad_values(self):
        for bad in [{"replicas": 3}, {"auth": {"mode": "basic"}}, {"config": {"idempotency": {"ttl": "forever"}}},
                    {"redis": {"prefix": "{x}"}}, {"config": {"server": {"max_header_bytes": 100}}},
                    {"config": {"server": {"header_read_timeout": "soon"}}}, {"redis": {"localCacheBytes": -1}}]:
            with self.assertRaises(Exception, msg=str(bad)):
                render(bad)

    def test_an_identity_provider_is_rendered_with_its_ca(self):
        values = {"auth": {"mode": "oidc", "oidcIssuer": "https://keycloak.example.com/realms/acme",
                           "audience": "payments-api", "ca": {"configMap": "idp-ca", "key": "ca.pem"}}}
        docs = render(values)
        config = tomllib.loads(by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual(config["auth"]["oidc_issuer"], "https://keycloak.example.com/realms/acme")
        self.assertEqual(config["auth"]["ca_file"], "/etc/idemgate/ca/ca.pem")
        self.assertNotIn("hs256_secret", config["auth"])
        pod = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        self.assertIn({"name": "idp-ca", "configMap": {"name": "idp-ca"}}, pod["volumes"])
        self.assertNotIn("IDEMGATE_AUTH__HS256_SECRET", env_map(pod["containers"][0]))
        for bad in ["http://idp.example.com", "http://localhost:80@evil.example", "https://a@evil.example"]:
            with self.assertRaises(Exception, msg=bad):
                render({"auth": {"mode": "oidc", "oidcIssuer": bad}})
        with self.assertRaises(Exception, msg="oidc without an issuer"):
            render({"auth": {"mode": "oidc"}})

    def test_tenants_are_rendered_from_values(self):
        values = {"config": {"tenants": {"default": {"rate": "500/s", "max_concurrent_requests": 256},
                                         "acme": {"ttl": "72h", "rate": "2000/s", "burst": 100},
                                         "globex.example": {"max_body_bytes": 65536}}}}
        config = tomllib.loads(by_kind(render(values), "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual(config["tenants"]["default"], {"rate": "500/s", "max_concurrent_requests": 256})
        self.assertEqual(config["tenants"]["acme"], {"ttl": "72h", "rate": "2000/s", "burst": 100})
        self.assertEqual(config["tenants"]["globex.example"], {"max_body_bytes": 65536})
        for bad in [{"acme": {"rate": "fast"}}, {"acme": {"quota": 5}}, {"acme": {"burst": 0}}]:
            with self.assertRaises(Exception, msg=str(bad)):
                render({"config": {"tenants": bad}})

    def test_the_admin_api_is_off_unless_enabled_and_then_its_token_is_mounted(self):
        default = render({})
        self.assertNotIn("[admin]", by_kind(default, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual(by_kind(default, "Service", "-admin"), [])
        docs = render(self.cases["admin"])
        config = tomllib.loads(by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        # Beyond loopback, said to be intended: the Service is ClusterIP, the NetworkPolicy admits it.
        self.assertEqual(config["admin"], {"listen": "0.0.0.0:9100", "allow_remote": True,
                                           "token_file": "/etc/idemgate/admin/token"})
        pod = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.assertEqual(volumes["admin-token"]["secret"]["secretName"], "idemgate-admin")
        ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
        self.assertEqual(ports["admin"], 9100)
        service = by_kind(docs, "Service", "-admin")[0]["spec"]
        self.assertEqual((service["type"], service["ports"][0]["targetPort"]), ("ClusterIP", "admin"))
        with self.assertRaises(Exception, msg="enabled without a token Secret"):
            render({"admin": {"enabled": True}})

    def test_alert_rules_pass_promtool_and_are_the_charts(self):
        promtool = shutil.which("promtool")
        self.assertIsNotNone(promtool, "promtool missing: apt-get install prometheus (scripts/test installs it)")
        rules = CHART / "files" / "alerts.yaml"
        for args in (["check", "rules", str(rules)], ["test", "rules", str(ROOT / "helm" / "alerts_test.yaml")]):
            run = subprocess.run([promtool, *args], capture_output=True, text=True)
            self.assertEqual(run.returncode, 0, f"promtool {' '.join(args)}:\n{run.stdout}\n{run.stderr}")
        # The PrometheusRule carries exactly the rules promtool tested.
        rendered = by_kind(render(production_values()), "PrometheusRule")[0]["spec"]
        self.assertEqual(rendered, yaml.safe_load(rules.read_text()))
        alerts = {r["alert"] for g in rendered["groups"] for r in g["rules"]}
        self.assertEqual(alerts, {"IdemgateHeldKeysGrowing", "IdemgateFencedCompletions", "IdemgateOutcomeUnrecorded",
                                  "IdemgateJwksStale", "IdemgateTenantThrottled", "IdemgateRecordsRestored",
                                  "IdemgateCallbacksExpired"})

    def test_the_dashboard_and_the_alerts_use_only_metrics_idemgate_exports(self):
        import json
        import re
        dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
        rendered = by_kind(render(production_values()), "ConfigMap", "dashboard")[0]["data"]["idemgate.json"]
        self.assertEqual(json.loads(rendered), dashboard)
        self.assertEqual(by_kind(render({}), "ConfigMap", "dashboard"), [], "optional, off by default")
        exported = set()
        for source in list((ROOT / "libs").rglob("*.rs")) + list((ROOT / "services").rglob("*.rs")):
            if "/tests/" not in str(source):
                exported |= set(re.findall(r'"(idemgate_[a-z_]+)"', source.read_text()))
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        rules = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
        exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
        used = {re.sub(r"_bucket$", "", m) for e in exprs for m in re.findall(r"idemgate_[a-z_]+", e)}
        self.assertTrue(used, "no metrics found in the panels")
        self.assertEqual(used - exported, set(), "metrics no code exports")

    def test_limits_are_values_with_the_binarys_defaults(self):
        # The defaults of the limits table in docs/configuration.md, as the binary has them.
        config = tomllib.loads(by_kind(render({}), "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"])
        self.assertEqual({k: config["server"][k] for k in LIMITS["server"]}, LIMITS["server"])
        self.assertEqual(config["redis"]["local_cache_bytes"], LIMITS["redis"]["local_cache_bytes"])
        for route in config["routes"]:
            self.assertEqual(route["max_response_bytes"], LIMITS["route"]["max_response_bytes"])
        # The chart's own replay budget: half the binary's, to fit its 256Mi memory limit.
        self.assertEqual(config["server"]["max_replay_bytes_in_flight"], 128 * 1024 * 1024)

    def test_rendered_config_passes_check_config(self):
        self.assertTrue(BINARY.exists(), f"{BINARY} missing: build it with cargo build --workspace --bins")
        for name, values in self.cases.items():
            docs = render(values)
            config = by_kind(docs, "ConfigMap", "idemgate")[0]["data"]["idemgate.toml"]
            gateway = by_kind(docs, "Deployment", "idemgate")[0]["spec"]["template"]["spec"]["containers"][0]
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "idemgate.toml").write_text(config)
                env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMGATE_")}
                # The Deployment's environment, with stand-ins for the secret values.
                stand_ins = {
                    "IDEMGATE_POSTGRES__URL": "postgres://idemgate@db:5432/idemgate",
                    "IDEMGATE_REDIS__URL": "redis://redis:6379",
                    "IDEMGATE_AUTH__HS256_SECRET": "a-secret-of-enough-length",
                }
                for var, spec in env_map(gateway).items():
                    env[var] = stand_ins.get(var, spec.get("value", ""))
                mounted = (config.replace("/etc/idemgate/keys/", f"{tmp}/").replace("/etc/idemgate/admin/", f"{tmp}/")
                           .replace("/etc/idemgate/webhooks/", f"{tmp}/").replace("/etc/idemgate/callbacks/", f"{tmp}/"))
                if "[routes.webhook]" in config:
                    (Path(tmp) / "stripe").mkdir()
                    (Path(tmp) / "stripe" / "secret").write_text("whsec_a-stripe-secret\n")
                    (Path(tmp) / "billing").mkdir()
                    (Path(tmp) / "billing" / "acme").write_text("whsec_aWRlbWdhdGUtY2hhcnQtc2VjcmV0LTAx\n")
                if "callback_secret_file" in config:
                    (Path(tmp) / "acme").mkdir()
                    (Path(tmp) / "acme" / "secret").write_text("whsec_aWRlbWdhdGUtY2hhcnQtc2VjcmV0LTAx\n")
                if "[admin]" in config:
                    (Path(tmp) / "token").write_text("an-admin-token-of-enough-length\n")
                if "jwks_file" in config:
                    (Path(tmp) / "jwks.json").write_text(
                        (ROOT / "libs" / "auth" / "tests" / "fixtures" / "jwks.json").read_text())
                (Path(tmp) / "idemgate.toml").write_text(mounted)
                run = subprocess.run([str(BINARY), "check-config", "--config", f"{tmp}/idemgate.toml"],
                                     capture_output=True, text=True, env=env)
                self.assertEqual(run.returncode, 0, f"{name}: {run.stderr}\n{mounted}")


if __name__ == "__main__":
    helm.disable_logging() if hasattr(helm, "disable_logging") else None
    runner = unittest.TextTestRunner(verbosity=2)
    result = runner.run(unittest.defaultTestLoader.loadTestsFromTestCase(ChartTest))
    failed = len(result.failures) + len(result.errors)
    # In cargo's words, so scripts/test's closing line counts these too.
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {result.testsRun - failed} passed; {failed} failed; chart tests")
    sys.exit(0 if failed == 0 else 1)
