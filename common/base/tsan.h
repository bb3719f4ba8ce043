/*
 * tsan — happens-before annotations for ThreadSanitizer builds.
 *
 * gRPC core, its gpr and the abseil it synchronizes with are Debian's
 * uninstrumented libraries, so ThreadSanitizer does not see that a tag handed
 * to grpc_call_start_batch (or grpc_server_request_*_call) on one thread and
 * returned by grpc_completion_queue_next on another orders the two threads:
 * gRPC's completion queue guarantees it, with locks TSan cannot observe. The
 * code that starts an operation releases its tag just before handing it to
 * gRPC, and the thread that takes the event acquires it, which tells TSan
 * exactly what gRPC guarantees and nothing more. Without -fsanitize=thread
 * both are empty.
 */
#ifndef ZS_COMMON_TSAN_H
#define ZS_COMMON_TSAN_H

#if defined(__SANITIZE_THREAD__)
#define ZS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ZS_TSAN 1
#endif
#endif

#ifdef ZS_TSAN
/* The ThreadSanitizer runtime's own entry points (libtsan). */
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
#define tsan_release(addr) __tsan_release((void *)(addr))
#define tsan_acquire(addr) __tsan_acquire((void *)(addr))
/* The memory accesses between the two are not recorded: for a call into
 * gRPC that frees memory gRPC itself shares between threads (a message's
 * slice is a reference into a read buffer other calls' messages also point
 * into; the last reference, on whichever thread, frees it), where the
 * ordering is gRPC's atomic reference count, which TSan cannot see. */
#define tsan_ignore_begin() __tsan_ignore_thread_begin()
#define tsan_ignore_end() __tsan_ignore_thread_end()
#else
#define tsan_release(addr) ((void)(addr))
#define tsan_acquire(addr) ((void)(addr))
#define tsan_ignore_begin() ((void)0)
#define tsan_ignore_end() ((void)0)
#endif

#endif
