/*
 * inf_crc32c: CRC-32C (Castagnoli, the iSCSI/ext4/RocksDB checksum) of a memory range.
 *
 * The result is the standard CRC-32C (RFC 3720: reflected polynomial 0x82F63B78, initial value
 * and final xor 0xFFFFFFFF), chainable: the CRC of A then B is inf_crc32c of B started from the
 * CRC of A. The x86 SSE4.2 `crc32` instruction is used when the CPU has it (three interleaved
 * streams hide its latency), else a slicing-by-8 table.
 *
 * Return values: 0 on success, -errno on failure. Thread-safe; holds no state but tables that
 * are built once.
 */
#ifndef INF_CRC32C_H
#define INF_CRC32C_H

#include <stdint.h>

#define INF_CRC32C_AUTO 0     /* the fastest this CPU offers */
#define INF_CRC32C_PORTABLE 1 /* the table, on any CPU */
#define INF_CRC32C_HARDWARE 2 /* the SSE4.2 instruction; -ENOTSUP where the CPU lacks it */

/* *out = CRC-32C of nbytes at buf, continuing from crc (0 to start). -EINVAL for an unknown
 * implementation, -ENOTSUP when INF_CRC32C_HARDWARE is asked of a CPU without it. */
int inf_crc32c(const void *buf, uint64_t nbytes, uint32_t crc, int implementation, uint32_t *out);

/* 1 when INF_CRC32C_HARDWARE works on this CPU, else 0. */
int inf_crc32c_hardware_available(void);

#endif /* INF_CRC32C_H */
