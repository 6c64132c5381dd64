#!/bin/sh
# Make a Chromium available for the browser test (tests/ui), from the
# distribution's packages: Playwright drives it with `executable_path`, and
# never downloads a browser of its own (nothing outside the package
# registries can be reached). Also an emoji font, so the screenshots show the
# cluster view's coloured markers rather than empty boxes. Quiet, and never
# fails the caller: without Chromium the browser test skips and says why.
#
#   sh infra/ensure-chromium.sh        # `make test` calls it before the suite

have_chromium() {
    for name in chromium chromium-browser google-chrome google-chrome-stable; do
        command -v "$name" >/dev/null 2>&1 && return 0
    done
    return 1
}

have_emoji_font() {
    command -v fc-list >/dev/null 2>&1 && fc-list 2>/dev/null | grep -qi emoji
}

packages=""
have_chromium || packages="chromium"
have_emoji_font || packages="$packages fonts-noto-color-emoji"
[ -z "$packages" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    have_chromium || echo "ensure-chromium: no chromium here and cannot install one (needs root and apt-get); the browser test will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log="${TMPDIR:-/tmp}/ensure-chromium.log"
# shellcheck disable=SC2086  # word splitting of the package list is meant
if ! apt-get install -y -qq $packages >"$log" 2>&1; then
    # the package lists may be missing or stale on a fresh machine
    apt-get update -qq >>"$log" 2>&1 && apt-get install -y -qq $packages >>"$log" 2>&1
fi
if have_chromium; then
    case "$packages" in *chromium*) echo "ensure-chromium: installed $(chromium --version 2>/dev/null)" ;; esac
else
    echo "ensure-chromium: could not install chromium (see $log); the browser test will skip" >&2
fi
exit 0
