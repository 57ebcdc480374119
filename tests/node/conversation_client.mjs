// A person's Nostr client for tenexd's end-to-end tests, built on nostr-tools.
// One JSON request on stdin, one JSON object on stdout.
//
//   {"op": "converse", "relay": url, "secret": hex, "template": {kind, content, tags},
//    "thread_root": id (optional: the published event is the root when absent),
//    "reply_authors": [hex...], "want": n, "timeout_ms": n, "reply_kinds": [1, 1111] (the default),
//    "exclude": [id...] (replies already seen, not counted again)}
//     subscribes to the replies in the thread by those authors (kind 1111 naming the root in `E`,
//     other kinds, such as kind 1, naming the root or the published event in an `e` tag), publishes
//     the event, and waits for `want` replies. Prints {published, replies, valid, latency_ms,
//     nip10} (`nip10`: nostr-tools' nip10.parse of each reply). With "partials": true it also
//     collects the agents' kind-21111 partial texts tagged with the thread root, in arrival order,
//     as `partials`.
//   {"op": "publish", "relay": url, "secret": hex, "template": {...}}  -> {published}
//   {"op": "query", "relay": url, "filters": [...], "timeout_ms": n}  -> {events} (until EOSE)
import * as nip10 from 'nostr-tools/nip10'
import { finalizeEvent, verifyEvent } from 'nostr-tools/pure'
import { Relay, useWebSocketImplementation } from 'nostr-tools/relay'
import WebSocket from 'ws'

useWebSocketImplementation(WebSocket)

const hexToBytes = (hex) => new Uint8Array(Buffer.from(hex, 'hex'))
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

async function readStdin() {
  const chunks = []
  for await (const chunk of process.stdin) chunks.push(chunk)
  return JSON.parse(Buffer.concat(chunks).toString('utf8'))
}

async function connect(url, deadline) {
  for (;;) {
    try {
      return await Relay.connect(url)
    } catch (err) {
      if (Date.now() > deadline) throw err
      await sleep(100)
    }
  }
}

// The filters of the replies `converse` waits for: NIP-22 comments name the root in `E`; kind-1
// replies (NIP-10) name it in an `e` tag, or name the published event there when the daemon joined a
// top-level note to an open channel conversation, whose root is an earlier note.
function replyFilters(kinds, ids, authors, since) {
  const filters = []
  if (kinds.includes(1111)) filters.push({ kinds: [1111], '#E': [ids[0]], authors, since })
  const others = kinds.filter((kind) => kind !== 1111)
  if (others.length) filters.push({ kinds: others, '#e': ids, authors, since })
  return filters
}

function sign(secret, template) {
  return finalizeEvent(
    { kind: template.kind, content: template.content, tags: template.tags ?? [], created_at: Math.floor(Date.now() / 1000) },
    hexToBytes(secret),
  )
}

async function converse(req) {
  const deadline = Date.now() + (req.timeout_ms ?? 5000)
  const relay = await connect(req.relay, deadline + 5000)
  const event = sign(req.secret, req.template)
  const root = req.thread_root ?? event.id
  const replies = []
  const latency = []
  let published = 0
  let done
  const finished = new Promise((resolve) => { done = resolve })
  const since = req.since ?? Math.floor(Date.now() / 1000) - 5
  const ids = [...new Set([root, event.id])]
  const sub = relay.subscribe(
    replyFilters(req.reply_kinds ?? [1, 1111], ids, req.reply_authors, since),
    {
      onevent(reply) {
        if (replies.some((r) => r.id === reply.id) || (req.exclude ?? []).includes(reply.id)) return
        replies.push(reply)
        latency.push(Date.now() - published)
        if (replies.length >= (req.want ?? 1)) done()
      },
    },
  )
  const partials = []
  const partialSub = req.partials
    ? relay.subscribe([{ kinds: [21111], '#e': [root], authors: req.reply_authors }], {
        onevent(partial) { partials.push(partial) },
      })
    : null
  await sleep(50)
  published = Date.now()
  await relay.publish(event)
  const timer = setTimeout(done, Math.max(0, deadline - Date.now()))
  await finished
  clearTimeout(timer)
  sub.close()
  if (partialSub) partialSub.close()
  relay.close()
  const valid = replies.map((r) => verifyEvent({ ...r }))
  return { published: event, replies, valid, latency_ms: latency, partials, nip10: replies.map((r) => nip10.parse(r)) }
}

async function query(req) {
  const relay = await connect(req.relay, Date.now() + 10000)
  const events = []
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, req.timeout_ms ?? 5000)
    const sub = relay.subscribe(req.filters, {
      onevent(event) { events.push(event) },
      oneose() { clearTimeout(timer); sub.close(); resolve() },
    })
  })
  relay.close()
  return { events }
}

async function publishOnly(req) {
  const relay = await connect(req.relay, Date.now() + 10000)
  const event = sign(req.secret, req.template)
  await relay.publish(event)
  relay.close()
  return { published: event }
}

const req = await readStdin()
const ops = { converse, publish: publishOnly, query }
const result = await (ops[req.op] ?? publishOnly)(req)
// exit once the answer is written: a pipe takes 64 KiB at a time, and exiting earlier cuts a long answer
process.stdout.write(JSON.stringify(result) + '\n', () => process.exit(0))
