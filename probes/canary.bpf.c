/* The self-cost canary: an entry and a return probe on one libc function in kvwatch's own
 * process, counting their runs. What a probed call costs the caller (the two traps and a
 * minimal program) is timed around them in Python (probes/canary.py); the counts prove
 * every call was trapped. Hit 0: entries, hit 1: returns. */
#include "common.h"

int kvw_canary_enter(struct pt_regs *ctx) {
    kvw_hit(0);
    return 0;
}

int kvw_canary_return(struct pt_regs *ctx) {
    kvw_hit(1);
    return 0;
}
