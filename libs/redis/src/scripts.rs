//! The Lua scripts of the fast path. Each touches only the keys of one scope (one hash
//! slot) and runs atomically, so each decision costs one round trip.

use std::sync::LazyLock;

use redis::Script;

/// KEYS: response, lock. ARGV: token, lease ms.
/// Returns `{1, response, pttl}` (cached), `{2}` (lock taken), `{3, held ms}` (locked) or
/// `{4, error}` when the lock could not be written (e.g. OOM under `maxmemory`): Redis
/// is up but cannot help with this request, which is no reason to open the breaker.
pub static LOOKUP: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local r = redis.call('GET', KEYS[1])
        if r then return {1, r, redis.call('PTTL', KEYS[1])} end
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local set = redis.pcall('SET', KEYS[2], ARGV[1] .. ':' .. now, 'NX', 'PX', ARGV[2])
        if type(set) == 'table' and set.err then return {4, set.err} end
        if set then return {2} end
        local held = 0
        local l = redis.call('GET', KEYS[2])
        if l then
            local at = tonumber(string.match(l, ':(%d+)$'))
            if at then held = now - at end
        end
        return {3, held}
        ",
    )
});

/// [`LOOKUP`] without the lock (`redis.lock = false`): `{1, response, pttl}` (cached) or
/// `{5}` (no answer: the ledger decides). Same keys and arguments.
pub static READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local r = redis.call('GET', KEYS[1])
        if r then return {1, r, redis.call('PTTL', KEYS[1])} end
        return {5}
        ",
    )
});

/// KEYS: response, lock. ARGV: entry, ttl ms, token, channel.
/// Caches the response (unless Redis refuses the write, e.g. OOM), drops the lock if
/// this attempt still holds it, announces it.
pub static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        redis.pcall('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
        local l = redis.call('GET', KEYS[2])
        if l and string.sub(l, 1, string.len(ARGV[3]) + 1) == ARGV[3] .. ':' then
            redis.call('DEL', KEYS[2])
        end
        redis.call('PUBLISH', ARGV[4], 'completed')
        return 1
        ",
    )
});

/// KEYS: lock. ARGV: token, channel. Compare-and-delete, then announce.
pub static UNLOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local l = redis.call('GET', KEYS[1])
        local deleted = 0
        if l and string.sub(l, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ':' then
            deleted = redis.call('DEL', KEYS[1])
        end
        redis.call('PUBLISH', ARGV[2], 'released')
        return deleted
        ",
    )
});
