#!/usr/bin/env python3
"""Checks the chart's generated certificates (rendered with the default values):
- internal TLS: one kubernetes.io/tls Secret per role, each certificate naming its role in its
  common name (ferry-<role>) and the server name in its DNS names, signed by the CA shipped
  beside it (one CA for all three); every Ferry container passes the mutual TLS flags and none
  --insecure-internal;
- the bundled etcd's TLS: its server certificate names the etcd Service, and it and Ferry's
  client certificate chain to the same etcd CA; etcd requires client certificates and every
  Ferry container passes --etcd-ca/-cert/-key.
Usage: check_tls.py RENDERED.yaml"""
import base64, subprocess, sys, tempfile, os
import yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret" and "-internal-tls-" in d["metadata"]["name"]}
cas = set()
with tempfile.TemporaryDirectory() as tmp:
    for role in ["router", "prefill", "decode"]:
        [s] = [s for n, s in secrets.items() if n.endswith(f"-internal-tls-{role}")]
        assert s["type"] == "kubernetes.io/tls", s["type"]
        files = {}
        for k in ["tls.crt", "tls.key", "ca.crt"]:
            files[k] = os.path.join(tmp, f"{role}-{k}")
            open(files[k], "wb").write(base64.b64decode(s["data"][k]))
        cas.add(s["data"]["ca.crt"])
        subj = subprocess.run(["openssl", "x509", "-noout", "-subject", "-in", files["tls.crt"]], check=True, capture_output=True, text=True).stdout
        assert f"CN = ferry-{role}" in subj or f"CN=ferry-{role}" in subj, subj
        san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", files["tls.crt"]], check=True, capture_output=True, text=True).stdout
        assert "DNS:ferry.internal" in san, san
        subprocess.run(["openssl", "verify", "-CAfile", files["ca.crt"], files["tls.crt"]], check=True, capture_output=True)
        print(f"{role}: {subj.strip()}; {san.split(chr(10))[1].strip()}; verified against its CA")
assert len(cas) == 1, "one CA signs every role"
for d in docs:
    if d["kind"] != "Deployment":
        continue
    for c in d["spec"]["template"]["spec"]["containers"]:
        args = c.get("args", []) + c.get("command", [])
        assert "--insecure-internal" not in args, d["metadata"]["name"]
        assert any(a.startswith("--internal-tls-cert=") for a in args), d["metadata"]["name"]
print(f"{len(secrets)} internal TLS Secrets, one CA; every Deployment runs mutual TLS")

def cert_files(secret, tmp, tag):
    out = {}
    for k in ["tls.crt", "tls.key", "ca.crt"]:
        out[k] = os.path.join(tmp, f"{tag}-{k}")
        open(out[k], "wb").write(base64.b64decode(secret["data"][k]))
    return out

etcd = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith(("-etcd-server", "-etcd-client"))}
[server] = [s for n, s in etcd.items() if n.endswith("-etcd-server")]
[client] = [s for n, s in etcd.items() if n.endswith("-etcd-client")]
assert server["data"]["ca.crt"] == client["data"]["ca.crt"], "one etcd CA"
with tempfile.TemporaryDirectory() as tmp:
    sf, cf = cert_files(server, tmp, "server"), cert_files(client, tmp, "client")
    for f in (sf, cf):
        subprocess.run(["openssl", "verify", "-CAfile", f["ca.crt"], f["tls.crt"]], check=True, capture_output=True)
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", sf["tls.crt"]], check=True, capture_output=True, text=True).stdout
    [svc] = [d["metadata"]["name"] for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-etcd")]
    assert f"DNS:{svc}," in san and "IP Address:127.0.0.1" in san, san
[sts] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-etcd")]
eargs = sts["spec"]["template"]["spec"]["containers"][0]["args"]
assert "--client-cert-auth" in eargs and any(a.startswith("--listen-client-urls=https://") for a in eargs), eargs
for d in docs:
    if d["kind"] == "Deployment":
        for c in d["spec"]["template"]["spec"]["containers"]:
            for flag in ["--etcd-ca=", "--etcd-cert=", "--etcd-key="]:
                assert any(a.startswith(flag) for a in c.get("args", [])), (d["metadata"]["name"], flag)
print(f"bundled etcd: TLS with client certificates; its certificate names {svc}; every Deployment reaches it over TLS")
