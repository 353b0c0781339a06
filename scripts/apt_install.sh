# Sourced by the install_*.sh scripts: one way to add the Debian packages an integration test
# uses. Idempotent and never fatal: when the packages are already there, when we are not root,
# or when apt-get is missing, it says why it did nothing and returns 0, and the test then skips
# with its own exact reason. Only packages are installed; no daemon is started or enabled.

# have TOOL...: each tool is on PATH or in /usr/sbin (where daemons are, off a user's PATH)
have() {
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || return 1
    done
}

# apt_install LABEL WHO_SKIPS PRESENT PACKAGE...
#   LABEL      how each line starts (the script's name)
#   WHO_SKIPS  the test that skips when nothing could be installed
#   PRESENT    a shell test that is true when the tools are already there
apt_install() {
    local label=$1 who_skips=$2 present=$3
    shift 3
    if eval "$present"; then
        echo "$label: $* already installed"
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "$label: not root, not installing $*; $who_skips will skip"
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$label: no apt-get on this machine; $who_skips will skip"
        return 0
    fi
    echo "$label: installing $*"
    export DEBIAN_FRONTEND=noninteractive
    local log="/tmp/$label.$$.log"
    if ! apt-get install -y --no-install-recommends "$@" >"$log" 2>&1; then
        # A fresh container has no package lists yet, or they are stale: refresh once and retry.
        apt-get update >>"$log" 2>&1
        if ! apt-get install -y --no-install-recommends "$@" >>"$log" 2>&1; then
            echo "$label: apt-get install failed (log: $log); $who_skips will skip"
            return 0
        fi
    fi
    rm -f "$log"
    echo "$label: installed $(dpkg-query -W -f='${Package} ${Version}  ' "$@" 2>/dev/null)"
}
