#!/usr/bin/env python3
"""Checks the chart's generated internal TLS (rendered with the default values): one
kubernetes.io/tls Secret per role, each certificate naming its role in its common name
(ferry-<role>) and the server name in its DNS names, signed by the CA shipped beside it (one CA
for all three); every Ferry container passes the mutual TLS flags and none --insecure-internal.
Usage: check_internal_tls.py RENDERED.yaml"""
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
