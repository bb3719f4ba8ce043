/*
 * cli — the `zshard` command line tool: one function per subcommand, each
 * taking the arguments after the subcommand's name and returning the exit
 * status.
 */
#ifndef ZSHARD_CLI_CLI_H
#define ZSHARD_CLI_CLI_H

#include <stddef.h>
#include <stdint.h>

int cli_status(int argc, char **argv);
int cli_estimate(int argc, char **argv);
/* ckpt.c */
int cli_checkpoint(int argc, char **argv);
int cli_restore(int argc, char **argv);
int cli_checkpoints(int argc, char **argv);
int cli_reshard(int argc, char **argv);
int cli_export(int argc, char **argv);

/* "12.3 GiB" style, into buf. */
const char *cli_bytes(double bytes, char *buf, size_t len);

/* Parses a count with an optional SI suffix (K, M, B or G, T: 7B, 1.3e9,
 * 350M). Returns 0 or -1. */
int cli_parse_count(const char *s, uint64_t *out);

#endif
