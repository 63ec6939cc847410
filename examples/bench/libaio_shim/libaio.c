/* The system calls behind libaio.h (see there for why this exists). */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The kernel's structures under other names, to check ours against them. */
#define iocb kernel_iocb
#define io_event kernel_io_event
#include <linux/aio_abi.h>
#undef iocb
#undef io_event

#include "libaio.h"

#if !defined(__LP64__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libaio shim: 64-bit little-endian Linux only"
#endif

#define SAME(ours, kernels) \
    _Static_assert(offsetof(struct iocb, ours) == offsetof(struct kernel_iocb, kernels), #ours " != " #kernels)
SAME(data, aio_data);
SAME(key, aio_key);
SAME(aio_rw_flags, aio_rw_flags);
SAME(aio_lio_opcode, aio_lio_opcode);
SAME(aio_reqprio, aio_reqprio);
SAME(aio_fildes, aio_fildes);
SAME(u.c.buf, aio_buf);
SAME(u.c.nbytes, aio_nbytes);
SAME(u.c.offset, aio_offset);
SAME(u.c.reserved2, aio_reserved2);
SAME(u.c.flags, aio_flags);
SAME(u.c.resfd, aio_resfd);
_Static_assert(sizeof(struct iocb) == sizeof(struct kernel_iocb), "struct iocb size");
_Static_assert(sizeof(struct io_event) == sizeof(struct kernel_io_event), "struct io_event size");
_Static_assert(offsetof(struct io_event, obj) == offsetof(struct kernel_io_event, obj), "io_event.obj");
_Static_assert(offsetof(struct io_event, res) == offsetof(struct kernel_io_event, res), "io_event.res");
_Static_assert((int)IO_CMD_PREAD == (int)IOCB_CMD_PREAD && (int)IO_CMD_PWRITE == (int)IOCB_CMD_PWRITE, "opcodes");

static int result(long value) { return value < 0 ? -errno : (int)value; }

int io_setup(int maxevents, io_context_t *ctxp) { return result(syscall(SYS_io_setup, maxevents, ctxp)); }

int io_destroy(io_context_t ctx) { return result(syscall(SYS_io_destroy, ctx)); }

int io_queue_init(int maxevents, io_context_t *ctxp)
{
    if (maxevents <= 0) return -EINVAL;
    *ctxp = NULL; /* io_setup refuses a context that is not zero */
    return io_setup(maxevents, ctxp);
}

int io_queue_release(io_context_t ctx) { return io_destroy(ctx); }

int io_submit(io_context_t ctx, long nr, struct iocb *ios[]) { return result(syscall(SYS_io_submit, ctx, nr, ios)); }

int io_cancel(io_context_t ctx, struct iocb *iocb, struct io_event *event)
{
    return result(syscall(SYS_io_cancel, ctx, iocb, event));
}

int io_getevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout)
{
    return result(syscall(SYS_io_getevents, ctx, min_nr, nr, events, timeout));
}

int io_pgetevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout,
                  sigset_t *sigmask)
{
    if (sigmask == NULL) return io_getevents(ctx, min_nr, nr, events, timeout);
    struct {
        const sigset_t *sigmask;
        size_t sigsetsize;
    } sigset = {sigmask, _NSIG / 8};
    return result(syscall(SYS_io_pgetevents, ctx, min_nr, nr, events, timeout, &sigset));
}
