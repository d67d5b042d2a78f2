# Sourced by the GPU carry scripts (bench/engine/*_carry.sh): the GPU machine gets the working
# tree but not ../shared and has no internet, so what a GPU run reads from ../shared, and the
# wheels its image lacks, travel in a git-ignored folder the device call carries. Wheels are the
# constraints.txt pins, for CPython 3.12 manylinux x86_64 (pure-Python ones where that is all
# there is).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
PIP="${PIP:-.venv/bin/python -m pip}"

# carry_start DIR: an empty DIR with whl/ and the GPT-2 tokenizer (every GPU bench reads it).
carry_start() {
    CARRY="$1"
    rm -rf "$CARRY" && mkdir -p "$CARRY/whl" "$CARRY/tokenizers"
    cp -r "$SHARED/tokenizers/gpt2" "$CARRY/tokenizers/"
}

# carry_wheels NAME...: each package's pinned wheel into $CARRY/whl.
carry_wheels() {
    local name spec
    for name in "$@"; do
        spec="$(grep -i "^$name==" constraints.txt | head -1)"
        [[ -n "$spec" ]] || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
        $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
            -d "$CARRY/whl" "$spec"
    done
}

carry_done() {
    du -sh "$CARRY"
}
