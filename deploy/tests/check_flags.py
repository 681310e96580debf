#!/usr/bin/env python3
"""Checks that every flag and FERRY_* variable the Helm chart and the systemd units pass to a
Ferry binary exists in that binary's --help.

  check_flags.py FERRY_BIN --rendered R.yaml [R2.yaml ...] --systemd DIR [--self-test]

FERRY_BIN is the `ferry` binary (`ferry prefill|decode|router --help` are the daemons' flags,
the same as ferry-prefill, ferry-decode, ferry-router). --self-test also checks that a made-up
flag and a made-up variable are caught.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

import yaml

_help_cache = {}


def known(binary, sub):
    if sub not in _help_cache:
        out = subprocess.run([binary, sub, "--help"], check=True, capture_output=True, text=True).stdout
        flags = set(re.findall(r"--([a-z0-9][a-z0-9-]*)", out))
        envs = set(re.findall(r"\[env: (FERRY_[A-Z0-9_]+)=", out))
        _help_cache[sub] = (flags, envs)
    return _help_cache[sub]


def chart_uses(paths):
    """(where, subcommand, flags, env names) for every container running `ferry`."""
    for p in paths:
        for doc in yaml.safe_load_all(Path(p).read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("command") != ["ferry"]:
                    continue
                args = c.get("args", [])
                flags = [a[2:].split("=")[0] for a in args[1:] if a.startswith("--")]
                envs = [e["name"] for e in c.get("env", []) if e["name"].startswith("FERRY_")]
                where = f"{p}: {doc['metadata']['name']}/{c['name']}"
                yield where, args[0], flags, envs
                # Exec probes running `ferry` (`ferry health` under mutual TLS).
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    cmd = c.get(probe, {}).get("exec", {}).get("command", [])
                    if cmd[:1] == ["ferry"]:
                        flags = [a[2:].split("=")[0] for a in cmd[2:] if a.startswith("--")]
                        yield f"{where} {probe}", cmd[1], flags, []


def unit_uses(d):
    d = Path(d)
    for unit in sorted(d.glob("*.service")):
        text = unit.read_text()
        m = re.search(r"^ExecStart=\S*/ferry-(router|prefill|decode)(.*)$", text, re.M)
        if not m:
            raise SystemExit(f"{unit}: no ExecStart of a Ferry daemon")
        sub, rest = m.group(1), m.group(2)
        flags = re.findall(r"--([a-z0-9][a-z0-9-]*)", rest)
        envs = re.findall(r"^Environment=(FERRY_[A-Z0-9_]+)=", text, re.M)
        for f in re.findall(r"^EnvironmentFile=-?/etc/ferry/([a-z]+)\.env$", text, re.M):
            env_file = d / "env" / f"{f}.env"
            envs += re.findall(r"^#?(FERRY_[A-Z0-9_]+)=", env_file.read_text(), re.M)
        yield str(unit), sub, flags, envs


def check(binary, uses):
    bad, n = [], 0
    for where, sub, flags, envs in uses:
        fl, ev = known(binary, sub)
        for f in flags:
            n += 1
            if f not in fl:
                bad.append(f"{where}: `ferry {sub}` has no --{f}")
        for e in envs:
            n += 1
            if e not in ev:
                bad.append(f"{where}: `ferry {sub}` reads no {e}")
    return n, bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--rendered", nargs="+", default=[])
    ap.add_argument("--systemd")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    uses = list(chart_uses(a.rendered)) + (list(unit_uses(a.systemd)) if a.systemd else [])
    n, bad = check(a.binary, uses)
    if a.self_test:
        _, caught = check(a.binary, [("self-test", "prefill", ["no-such-flag"], ["FERRY_NO_SUCH_VAR"])])
        if len(caught) != 2:
            raise SystemExit(f"self-test: a made-up flag and variable were not both caught: {caught}")
    for b in bad:
        print(b, file=sys.stderr)
    print(f"check_flags: {n} flags and variables in {len(uses)} containers and units; {len(bad)} unknown")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
