"""Which of a job spec's environment variables hold credentials: `hvdtrain render k8s` writes none of their values
into a manifest (they come from Secrets: the spec's `kubernetes.secret_env`).

A name is a credential's when it contains SECRET, PASSWORD, PASSWD, CREDENTIAL or CONNECTION_STRING, ends in _PWD,
or has TOKEN, KEY, APIKEY or KEYFILE between underscores (HF_TOKEN, AWS_ACCESS_KEY_ID, WANDB_API_KEY; not
TOKENIZERS_PARALLELISM); a value is one when it is a URL with a password (`scheme://user:password@host`). Names that
end in _FILE, _PATH or _DIR, and GOOGLE_APPLICATION_CREDENTIALS, hold a path to a file, not its content. A name
wrongly taken for a credential is written as given when `kubernetes.plain_env` lists it.
"""

from __future__ import annotations

import re

from hvdtrain.job.model import JobSpec

SECRET_PART = re.compile(r"SECRET|PASSWORD|PASSWD|CREDENTIAL|CONNECTION_STRING|_PWD$")
SECRET_WORDS = frozenset({"TOKEN", "KEY", "APIKEY", "KEYFILE"})
NOT_SECRET = re.compile(r"_(FILE|PATH|DIR)$|^GOOGLE_APPLICATION_CREDENTIALS$")
URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def looks_secret(name: str, value: str) -> bool:
    upper = name.upper()
    by_name = bool(SECRET_PART.search(upper) or SECRET_WORDS & set(upper.split("_"))) and not NOT_SECRET.search(upper)
    return by_name or bool(URL_PASSWORD.search(value))


def credential_names(spec: JobSpec) -> list[str]:
    """The spec's env names whose values look like credentials, but for those `kubernetes.plain_env` lists."""
    plain = set(spec.kubernetes.plain_env)
    return [name for name, value in spec.env.items() if name not in plain and looks_secret(name, value)]


def credential_problem(spec: JobSpec, controller: str) -> str | None:
    """Why the spec's env cannot go into a manifest as it is, with the fix; None when it can. `controller`: the
    job's ('gloo' or 'mpi')."""
    names = credential_names(spec)
    if names:
        first = names[0]
        return (f"env {', '.join(names)}: a credential would be written into the manifest as plain text. Put it in a "
                f"Secret (kubectl create secret generic job-secrets --from-literal={first}=...) and name it in the "
                f"spec instead: kubernetes: {{secret_env: {{{first}: {{secret: job-secrets, key: {first}}}}}}}, and "
                f"remove it from env; if it is not a credential, list it in kubernetes.plain_env")
    both = sorted(set(spec.env) & set(spec.kubernetes.secret_env))
    if both:
        return f"{', '.join(both)}: both in env and in kubernetes.secret_env; keep one"
    if spec.kubernetes.secret_env and spec.horovod.verbose and controller != "mpi":
        return ("horovod.verbose with kubernetes.secret_env under Gloo: horovodrun would print every rank's command, "
                "with the Secrets' values on it, into the launcher's log; set horovod.verbose: false, or controller: "
                "mpi (or --controller mpi: MPI passes variables by name)")
    return None
