/*
 * CRC-32C two ways: the SSE4.2 `crc32` instruction, and a slicing-by-8 table for any CPU.
 *
 * Both work on the raw register (no initial or final inversion; inf_crc32c adds them). The
 * instruction has a latency of about three cycles but can start one per cycle, so the hardware
 * path runs three independent streams over three adjacent blocks and joins them: the register
 * after A then B is shift_|B|(register after A) ^ (register of B from zero), where shift_n feeds
 * n zero bytes. shift_n is linear over GF(2) in the 32-bit register, so it is tabulated once per
 * block size as four 256-entry tables, one per byte of the register.
 */
#define _GNU_SOURCE
#include "inf_crc32c.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#define POLY 0x82F63B78u /* Castagnoli, bit-reflected */
#define LONG_BLOCK 8192  /* bytes per stream while at least three such blocks remain */
#define SHORT_BLOCK 256  /* then blocks of this size, then one stream */

struct shift_table {
    uint32_t by_byte[4][256];
};

static uint32_t slice[8][256];
static struct shift_table shift_long, shift_short;
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static uint32_t feed_zero_bytes(uint32_t crc, uint64_t nbytes)
{
    while (nbytes--)
        crc = slice[0][crc & 0xff] ^ (crc >> 8);
    return crc;
}

static void build_shift(struct shift_table *table, uint64_t nbytes)
{
    uint32_t column[32];

    for (int bit = 0; bit < 32; bit++)
        column[bit] = feed_zero_bytes(1u << bit, nbytes);
    for (int k = 0; k < 4; k++)
        for (int value = 0; value < 256; value++) {
            uint32_t sum = 0;
            for (int bit = 0; bit < 8; bit++)
                if (value & (1 << bit))
                    sum ^= column[8 * k + bit];
            table->by_byte[k][value] = sum;
        }
}

static void build_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc >> 1) ^ (POLY & (0u - (crc & 1)));
        slice[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            slice[k][n] = (slice[k - 1][n] >> 8) ^ slice[0][slice[k - 1][n] & 0xff];
    build_shift(&shift_long, LONG_BLOCK);
    build_shift(&shift_short, SHORT_BLOCK);
}

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t word;

    memcpy(&word, p, sizeof(word)); /* unaligned loads are fine on every target we build for */
    return word;
}

static uint32_t crc_portable(uint32_t crc, const unsigned char *p, uint64_t nbytes)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; nbytes >= 8; p += 8, nbytes -= 8) {
        uint64_t w = load64(p) ^ crc;
        crc = slice[7][w & 0xff] ^ slice[6][(w >> 8) & 0xff] ^ slice[5][(w >> 16) & 0xff] ^
              slice[4][(w >> 24) & 0xff] ^ slice[3][(w >> 32) & 0xff] ^
              slice[2][(w >> 40) & 0xff] ^ slice[1][(w >> 48) & 0xff] ^ slice[0][w >> 56];
    }
#endif
    for (; nbytes; p++, nbytes--)
        crc = slice[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

static inline uint64_t shift(const struct shift_table *table, uint64_t crc)
{
    return table->by_byte[0][crc & 0xff] ^ table->by_byte[1][(crc >> 8) & 0xff] ^
           table->by_byte[2][(crc >> 16) & 0xff] ^ table->by_byte[3][(crc >> 24) & 0xff];
}

/* Three streams over blocks [0, B), [B, 2B), [2B, 3B) while 3B bytes remain; B is a constant
 * at each call site, so the loop is unrolled for it. */
#define THREE_STREAMS(block, table)                                                            \
    while (nbytes >= 3 * (block)) {                                                            \
        uint64_t c1 = 0, c2 = 0;                                                               \
        for (const unsigned char *end = p + (block); p < end; p += 8) {                        \
            c0 = _mm_crc32_u64(c0, load64(p));                                                 \
            c1 = _mm_crc32_u64(c1, load64(p + (block)));                                       \
            c2 = _mm_crc32_u64(c2, load64(p + 2 * (block)));                                   \
        }                                                                                      \
        c0 = shift(table, c0) ^ c1;                                                            \
        c0 = shift(table, c0) ^ c2;                                                            \
        p += 2 * (block);                                                                      \
        nbytes -= 3 * (block);                                                                 \
    }

__attribute__((target("sse4.2"))) static uint32_t crc_hardware(uint32_t crc,
                                                              const unsigned char *p,
                                                              uint64_t nbytes)
{
    uint64_t c0 = crc;

    THREE_STREAMS(LONG_BLOCK, &shift_long)
    THREE_STREAMS(SHORT_BLOCK, &shift_short)
    for (; nbytes >= 8; p += 8, nbytes -= 8)
        c0 = _mm_crc32_u64(c0, load64(p));
    for (; nbytes; p++, nbytes--)
        c0 = _mm_crc32_u8((uint32_t)c0, *p);
    return (uint32_t)c0;
}

int inf_crc32c_hardware_available(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}
#else
static uint32_t crc_hardware(uint32_t crc, const unsigned char *p, uint64_t nbytes)
{
    return crc_portable(crc, p, nbytes); /* never reached: not available */
}

int inf_crc32c_hardware_available(void)
{
    return 0;
}
#endif

int inf_crc32c(const void *buf, uint64_t nbytes, uint32_t crc, int implementation, uint32_t *out)
{
    int hardware = inf_crc32c_hardware_available();

    switch (implementation) {
    case INF_CRC32C_AUTO: break;
    case INF_CRC32C_PORTABLE: hardware = 0; break;
    case INF_CRC32C_HARDWARE:
        if (!hardware)
            return -ENOTSUP;
        break;
    default: return -EINVAL;
    }
    pthread_once(&tables_once, build_tables);
    crc = ~crc;
    crc = hardware ? crc_hardware(crc, buf, nbytes) : crc_portable(crc, buf, nbytes);
    *out = ~crc;
    return 0;
}
