# shellcheck shell=bash
# Sourced by the scripts in scripts/train/multinode/ and scripts/train/debug/ppo_multinode_local.sh:
# which python and ray to run, and Ray's token authentication, in one place.
#
# Ray 2.60 (pinned in requirements-common.txt) authenticates every connection to a cluster with a shared
# token when RAY_AUTH_MODE=token: the head, every worker node and every driver (the trainer) must see the
# same token, either as the RAY_AUTH_TOKEN environment variable (the token itself) or in the file
# RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token). A node or driver without it is refused with
# `AuthenticationError ... InvalidAuthToken`; a driver given an explicit address without RAY_AUTH_MODE=token
# fails with `ConnectionError: Failed to connect to Ray cluster`.

# The caller sets SCRIPT_NAME (for messages) and REPO (the repository root).
die() { echo "[$SCRIPT_NAME] error: $*" >&2; exit 2; }
say() { echo "[$SCRIPT_NAME] $*"; }

# Sets $python and $ray: the repo's .venv (or OPEN_INSTRUCT_VENV), or the active python with
# OPEN_INSTRUCT_CURRENT_ENV=1, as scripts/train/debug/ppo.sh does.
find_python_and_ray() {
  python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
  if [[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]]; then python="$(command -v python3 || true)"; fi
  [[ -x "$python" ]] ||
    die "no python at '$python'; run 'bash scripts/install.sh' on this node first (or set OPEN_INSTRUCT_VENV)."
  ray="$(dirname "$python")/ray"
  [[ -x "$ray" ]] || die "no ray next to $python; run 'bash scripts/install.sh' on this node first."
  local version  # from the package metadata: importing ray to ask it takes seconds
  version="$("$python" -c 'import importlib.metadata as m; print(m.version("ray"))' 2>/dev/null || echo none)"
  [[ "$version" =~ ^2\.(6[0-9]|[7-9][0-9])\. ]] ||
    die "Ray $version here; these scripts need Ray 2.60 (token authentication; requirements-common.txt):" \
      "run 'bash scripts/install.sh'."
}

# Exports RAY_AUTH_MODE (default token) and, unless RAY_AUTH_TOKEN holds the token itself,
# RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token). With `create` and no token yet, writes a new random
# one (256 bits, hex, as `ray get-auth-token --generate` makes), readable by this user only.
ray_auth_env() {
  local create="${1:-}"
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
  case "$RAY_AUTH_MODE" in
    disabled)
      say "warning: RAY_AUTH_MODE=disabled: anyone who can reach this cluster's ports can run code on it"
      return ;;
    token) ;;
    *) die "RAY_AUTH_MODE=$RAY_AUTH_MODE is not 'token' or 'disabled'; unset it to use token authentication." ;;
  esac
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    say "token authentication: the token in RAY_AUTH_TOKEN"
    return
  fi
  export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
    if [[ "$create" != create ]]; then
      die "token authentication is on but there is no token in $RAY_AUTH_TOKEN_PATH; copy the head node's" \
        "token file there (e.g. scp HEAD:$RAY_AUTH_TOKEN_PATH $RAY_AUTH_TOKEN_PATH), or point RAY_AUTH_TOKEN_PATH" \
        "at it, or set RAY_AUTH_TOKEN."
    fi
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RAY_AUTH_TOKEN_PATH")
    say "created a new Ray auth token in $RAY_AUTH_TOKEN_PATH; every worker node and the trainer need the same file"
  fi
  say "token authentication: RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"
}

# Waits until the cluster at $1 has $2 live nodes and prints them; fails with the reason otherwise.
wait_for_nodes() {
  "$python" "$REPO/scripts/train/multinode/wait_for_nodes.py" --address "$1" --nodes "$2" --timeout_s "${3:-300}"
}
