/* The KV events replay (events-replay-endpoint): the socket thread folds every event batch it
 * publishes into a mirror of the sessions announced and not removed, and answers a
 * KvReplayRequest from it with the sequence number of the last event published. The mirror is
 * the stream's own fold, so a subscriber that applies the snapshot and then the stream's events
 * above that number holds what one that never missed an event holds. Socket thread only. */
#ifndef SKV_EVENTS_REPLAY_H
#define SKV_EVENTS_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct skv_events_mirror;

int skv_events_mirror_new(struct skv_events_mirror **out);
/* Accepts NULL and *m == NULL. */
void skv_events_mirror_free(struct skv_events_mirror **m);
/* Folds one published KvEventBatch (packed) in: a SessionStored adds or replaces its session, a
 * SessionRemoved removes it, AllCleared empties the mirror. A batch that does not decode, or a
 * session the mirror has no memory for, is logged and left out (a replay then lacks it, as a
 * subscriber that missed that event would). */
void skv_events_mirror_apply(struct skv_events_mirror *m, const void *body, size_t len);
/* Sessions in the mirror. */
size_t skv_events_mirror_count(const struct skv_events_mirror *m);

/* Events per part of a replay. */
#define SKV_REPLAY_PART_EVENTS 64

/* Reads one request from `sock` (a ROUTER: [identity][KvReplayRequest]) and sends the snapshot to
 * it as parts [sequence, big-endian][KvReplayReply] (their batches carry boot_id, the events'),
 * or one reply with a status for a request
 * that is not one. Nothing waits: a part the socket cannot take now (the subscriber is gone or
 * does not read) ends the reply there. False when no request was waiting. */
bool skv_events_mirror_serve(struct skv_events_mirror *m, void *sock, uint64_t sequence, uint64_t boot_id);

#endif
