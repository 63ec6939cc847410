"""The optimizers: the host AdamW kernel and its worker thread, exact clipping (speculation, rollback, deferral), the GPU AdamW of resident parts, loss scaling."""
