/*
 * Fuzz target: raw KV event batches (csrc/ingest_decode.c: plan_read through
 * scan_batch and Core.apply_raw into a real core), against the typed decoder
 * and KvIndex.apply, with injected allocation failures. The checks are
 * fuzz_targets.ingest_one (input layout there: two control bytes, then up to
 * 8 payloads separated by C1 'F' 'Z' C1).
 */
#include "embed.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    long live = fz_live();
    fz_check("ingest_one", Py_BuildValue("(y#)", (const char *)data, (Py_ssize_t)size));
    fz_no_leak(live); /* both indexes of the input are gone by now */
    return 0;
}
