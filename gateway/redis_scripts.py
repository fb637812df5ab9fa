"""The Lua scripts behind ``gateway.redis_state.RedisState``: each of its operations on
Redis is one script, atomic, in one hash slot (the key layout is described there).

A script is given its slot's first key (``KEYS[1]``) and derives the others from the
prefix in ``ARGV[1]``. Block hashes travel as decimal strings; Lua never does arithmetic
on them. Sums of floats are returned as strings: Redis truncates Lua numbers to integers.
"""

NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
"""

READ = """
local function charged_by_others(p, r, ids)
  local all = redis.call('HMGET', p .. 'charges', unpack(ids))
  local own = redis.call('HMGET', p .. 'charged-by:' .. r, unpack(ids))
  local counts = {}
  for i = 1, #ids do counts[i] = (tonumber(all[i]) or 0) - (tonumber(own[i]) or 0) end
  return counts
end
local function foreign(p, r, ids)
  local n, sums, marks = #ids, {}, {}
  for i = 1, 2 * n do sums[i] = 0 end
  local live = redis.call('ZRANGEBYSCORE', p .. 'replicas', now, '+inf')
  table.sort(live)
  for _, other in ipairs(live) do
    if other ~= r then
      marks[#marks + 1] = other .. '=' .. (redis.call('HGET', p .. 'changes', other) or '0')
      local a = redis.call('HMGET', p .. 'acct:' .. other .. ':pending', unpack(ids))
      local b = redis.call('HMGET', p .. 'acct:' .. other .. ':inflight', unpack(ids))
      for i = 1, n do
        sums[i] = sums[i] + math.max(tonumber(a[i]) or 0, 0)
        sums[n + i] = sums[n + i] + math.max(tonumber(b[i]) or 0, 0)
      end
    end
  end
  for i = 1, 2 * n do sums[i] = tostring(sums[i]) end
  for i, count in ipairs(charged_by_others(p, r, ids)) do sums[2 * n + i] = tostring(count) end
  return sums, table.concat(marks, ',')
end
local function holders(p, blocks)
  local found = {}
  for k, block in ipairs(blocks) do
    found[k] = redis.call('SMEMBERS', p .. 'px:' .. block)
    if #found[k] == 0 then break end
  end
  return found
end
"""
"""Lua shared by the scripts that read a pool: the other live replicas' accounting of
``ids``, the requests they charged to each (``charges`` less ``r``'s own), and the mark of
their shares' rewrites per replica; and the holders of each block up to the first that
none holds. A replica's share below 0 counts 0: its releases of requests it charged while
Redis was away (or whose charge's answer was lost) land there without their charge until
its next rewrite, and a negative load would draw the others' requests to the instance."""

VIEW = (
    NOW
    + READ
    + """
local p, r, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ids, blocks = {}, {}
for i = 1, n do ids[i] = ARGV[3 + i] end
for k = 4 + n, #ARGV do blocks[#blocks + 1] = ARGV[k] end
local sums, mark = foreign(p, r, ids)
return {sums, mark, holders(p, blocks)}
"""
)

ACCOUNT = (
    NOW
    + """
local p, r, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local share = p .. 'acct:' .. r
local function account(id, pending, inflight)
  redis.call('HINCRBYFLOAT', share .. ':pending', id, pending)
  redis.call('HINCRBYFLOAT', share .. ':inflight', id, inflight)
end
local function keep_alive()
  redis.call('PEXPIRE', share .. ':pending', math.ceil(ttl * 1000))
  redis.call('PEXPIRE', share .. ':inflight', math.ceil(ttl * 1000))
  redis.call('ZADD', p .. 'replicas', now + ttl, r)
end
local function rewrote()
  redis.call('HINCRBY', p .. 'changes', r, 1)
  keep_alive()
end
local function account_all()
  local n = tonumber(ARGV[4])
  for i = 1, n do account(ARGV[4 + i], ARGV[4 + n + i], ARGV[4 + 2 * n + i]) end
  return n
end
"""
)
"""Lua shared by the scripts that write a replica's share: ARGV starts prefix, replica,
TTL, then a count n and n instance ids, n pending prefills and n in-flight tokens to add
(``account_all``, which answers n). ``rewrote`` counts a rewrite of the share, which
other replicas' views must not miss, in the pool's ``changes``; a charge counts in the
pool's ``charges`` (``ROUTED``), and a release alone moves neither."""

ADJUST = (
    ACCOUNT
    + """
account_all()
keep_alive()
return 0
"""
)

SYNC = (
    ACCOUNT
    + """
redis.call('DEL', share .. ':pending', share .. ':inflight')
account_all()
rewrote()
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', p .. 'replicas', '-inf', now)) do
  redis.call('HDEL', p .. 'changes', gone)
  redis.call('DEL', p .. 'charged-by:' .. gone)
end
redis.call('ZREMRANGEBYSCORE', p .. 'replicas', '-inf', now)
return 0
"""
)

ROUTED = (
    ACCOUNT
    + READ
    + """
local added = account_all()
local o = 4 + 3 * added
local id, capacity, mark = ARGV[o + 1], tonumber(ARGV[o + 2]), ARGV[o + 5]
local others_on_id, n = tonumber(ARGV[o + 6]), tonumber(ARGV[o + 7])
local ids, expected, seen, blocks = {}, {}, {}, {}
for i = 1, n do ids[i] = ARGV[o + 7 + i]; expected[i] = tonumber(ARGV[o + 7 + n + i]) end
local m = tonumber(ARGV[o + 8 + 2 * n])
for k = 1, m do seen[k] = ARGV[o + 8 + 2 * n + k] end
for k = o + 9 + 2 * n + m, #ARGV do blocks[#blocks + 1] = ARGV[k] end
local read = {}
if n > 0 then  -- a view's check: its pool's instances
  local sums, current = foreign(p, r, ids)
  read = {sums, current}
  local found = holders(p, seen)
  local same = current == mark
  for i = 1, n do  -- the others' charges to the instance chosen, as read just now
    if ids[i] == id then same = same and tonumber(sums[2 * n + i]) == others_on_id end
  end
  local credit = {}
  for _, held in ipairs(found) do
    for _, holder in ipairs(held) do credit[holder] = (credit[holder] or 0) + 1 end
  end
  for i = 1, n do same = same and (credit[ids[i]] or 0) == expected[i] end
  if not same then
    if added > 0 then keep_alive() end
    return {0, sums, current, found}
  end
end
redis.call('HINCRBY', p .. 'charges', id, 1)
redis.call('HINCRBY', p .. 'charged-by:' .. r, id, 1)
account(id, ARGV[o + 3], ARGV[o + 4])
keep_alive()
local lru = p .. 'lru:' .. id
for _, block in ipairs(blocks) do
  local order = redis.call('INCR', p .. 'lru-seq')
  redis.call('ZADD', lru, order, block)
  redis.call('SADD', p .. 'px:' .. block, id)
end
local forgotten = {}
local excess = redis.call('ZCARD', lru) - capacity
if excess > 0 then
  local gone = redis.call('ZPOPMIN', lru, excess)
  for k = 1, #gone, 2 do
    redis.call('SREM', p .. 'px:' .. gone[k], id)
    forgotten[#forgotten + 1] = gone[k]
  end
end
return {1, forgotten, unpack(read)}
"""
)
"""Add the replica's held changes (``account_all``: always, the charge refused or not),
then charge a request to ``id`` and index its blocks; with a mark (a view's), only if the
view is still what Redis holds where it bears on the choice: no other replica charged
``id`` or rewrote its share since, and the match of the view's blocks on ``ids`` as
expected. A charge to another instance since only made that one busier: it refuses
nothing (``docs/gateway.md`` says when it could still have moved the choice). Answers
``{1, blocks forgotten}`` when written (after a check, with the other replicas' state it
read: the caller's next view rests on it, at no call of its own), else ``{0, the fresh
read}``, on which the caller decides again."""

EVICTED = """
local p, id = ARGV[1], ARGV[2]
local lru = p .. 'lru:' .. id
for k = 3, #ARGV do
  if redis.call('ZREM', lru, ARGV[k]) == 1 then redis.call('SREM', p .. 'px:' .. ARGV[k], id) end
end
return 0
"""

CLEARED = """
local p, id = ARGV[1], ARGV[2]
local lru = p .. 'lru:' .. id
for _, block in ipairs(redis.call('ZRANGE', lru, 0, -1)) do
  redis.call('SREM', p .. 'px:' .. block, id)
end
redis.call('DEL', lru)
return 0
"""

RENEW = """
if redis.call('GET', KEYS[1]) == 'pending' then return redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 0
"""
"""Extend a pending idempotency claim's lease; 0 where the key holds an outcome (settled
meanwhile) or nothing."""

# A negative amount gives back what a refused request drew, never past the burst.
TAKE = """
local key, rate, burst, amount = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local state = redis.call('HMGET', key, 'level', 'at')
local level = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
level = math.min(burst, level + math.max(0, now - at) * rate)
local wait = 0
if level >= amount then level = math.min(burst, level - amount)
elseif rate > 0 and amount <= burst then wait = (amount - level) / rate
else wait = -1 end
redis.call('HSET', key, 'level', tostring(level), 'at', tostring(now))
if rate > 0 then redis.call('EXPIRE', key, math.ceil(burst / rate) + 60) end
return tostring(wait)
"""


LOADS = (
    NOW
    + """
local p, r, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ttl_ms = math.ceil(ttl * 1000)
if ARGV[4] == '' then
  redis.call('ZREM', p .. 'loads', r)
  redis.call('DEL', p .. 'load:' .. r)
  local none = {}
  for i = 5, #ARGV, 4 do
    redis.call('HDEL', p .. 'slots:' .. ARGV[i], r)
    none[#none + 1] = 0
  end
  return {{}, none}
end
redis.call('SET', p .. 'load:' .. r, ARGV[4], 'PX', ttl_ms)
redis.call('ZADD', p .. 'loads', now + ttl, r)
redis.call('ZREMRANGEBYSCORE', p .. 'loads', '-inf', now)
local live, others = {}, {}
for _, other in ipairs(redis.call('ZRANGEBYSCORE', p .. 'loads', now, '+inf')) do
  live[other] = true
  if other ~= r then
    local load = redis.call('GET', p .. 'load:' .. other)
    if load then others[#others + 1] = load end
  end
end
local granted = {}
for i = 5, #ARGV, 4 do
  local slots = p .. 'slots:' .. ARGV[i]
  local running, wanted, limit = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local held, holders = 0, redis.call('HGETALL', slots)
  for k = 1, #holders, 2 do
    if not live[holders[k]] then
      redis.call('HDEL', slots, holders[k])
    elseif holders[k] ~= r then
      held = held + tonumber(holders[k + 1])
    end
  end
  local grant = math.max(running, math.min(wanted, limit - held))
  redis.call('HSET', slots, r, grant)
  redis.call('PEXPIRE', slots, ttl_ms)
  granted[#granted + 1] = grant
end
return {others, granted}
"""
)
"""Publish replica ``r``'s admission load, read the other live replicas', and take the
ceiling slots it claims (``SlotClaim``: name, running, wanted, limit, four arguments
each): as many as it wants while the live replicas' slots stay within the limit, never
fewer than it runs. A replica whose load expired holds no slots; one whose load is empty
leaves: it is no longer counted, and its slots of the named claims go."""
