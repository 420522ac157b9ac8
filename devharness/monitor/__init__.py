"""Tools that drive or read an engine from outside: `check` (layer-by-layer comparison of layouts, kernel backends
and batches), the collectives and KV views, and `devharness bundle`'s client. What the running engine needs (hang
detection, bundles, reading the workers) is in devharness/diagnostics/."""
