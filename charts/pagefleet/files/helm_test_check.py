"""`helm test` check: the operator is up and the InferenceService API answers.

Runs inside the operator image (standard library only) with the operator's
ServiceAccount. Exit status 0 means both checks passed; every failure names its cause.
"""

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

DEADLINE_SECONDS = 120
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def wait_for_operator(url: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                print(f"operator liveness {url}: HTTP {response.status}")
                return
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                sys.exit(f"operator liveness {url} did not answer in {DEADLINE_SECONDS}s: {exc}")
            time.sleep(2)


def list_inference_services(namespace: str) -> int:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ["KUBERNETES_SERVICE_PORT"]
    url = (
        f"https://{host}:{port}/apis/pagefleet.dev/v1alpha1/namespaces/{namespace}"
        "/inferenceservices"
    )
    with open(f"{ACCOUNT}/token") as token_file:
        token = token_file.read().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return len(json.load(response)["items"])
    except urllib.error.HTTPError as exc:
        sys.exit(f"listing InferenceServices in {namespace}: HTTP {exc.code} {exc.reason}")


def main() -> None:
    wait_for_operator(os.environ["OPERATOR_HEALTH_URL"])
    namespace = os.environ["WATCHED_NAMESPACE"]
    count = list_inference_services(namespace)
    print(f"InferenceService API answers: {count} in namespace {namespace}")


if __name__ == "__main__":
    main()
