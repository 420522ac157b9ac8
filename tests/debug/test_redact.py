"""Masking secrets (debug/redact.py): the values of secret-named flags in a command line, and the values a process
registered, wherever they appear; JSON it masks stays JSON."""
import json
import secrets

from devharness.debug.redact import MASK, add_secret, redact


def test_secret_flags_values_are_masked_and_other_flags_are_not():
    line = ("Process 7: python -m devharness.cli serve --max-num-batched-tokens 512 --api-key K1 "
            "--debug-token=T2 --token  T3 --debug-port-base 5678 --client-secret S4 --db-password P5")
    assert redact(line) == ("Process 7: python -m devharness.cli serve --max-num-batched-tokens 512 --api-key "
                            f"{MASK} --debug-token={MASK} --token  {MASK} --debug-port-base 5678 --client-secret "
                            f"{MASK} --db-password {MASK}")
    assert redact(redact(line)) == redact(line)
    assert redact("--api-key\nPython v3.11") == "--api-key\nPython v3.11"   # a value is on its flag's line


def test_a_registered_secret_is_masked_anywhere_and_json_stays_json():
    value = secrets.token_hex(16)
    assert redact(f"x{value}y") == f"x{value}y"
    add_secret(value)
    add_secret(None)   # nothing to mask
    assert redact(f"x{value}y api_key='{value}'") == f"x{MASK}y api_key='{MASK}'"
    doc = json.dumps({"argv": f"serve --api-key {secrets.token_hex(8)}", "repr": f"Namespace(debug_token='{value}')"})
    assert json.loads(redact(doc)) == {"argv": f"serve --api-key {MASK}", "repr": f"Namespace(debug_token='{MASK}')"}
