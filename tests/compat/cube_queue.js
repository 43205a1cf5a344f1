// Cube's own QueryQueue (query-orchestrator 1.7) running against a queryqueue supervisor.
// The "Cube Store driver" below formats each command exactly as CubeStoreDriver.query does
// (sqlstring) and sends the text over the supervisor's socket; nothing else is faked.
'use strict';

const net = require('net');
const sqlstring = require('sqlstring');
const { QueryQueue } = require('@cubejs-backend/query-orchestrator');

const socketPath = process.argv[2];

function connect() {
  const socket = net.createConnection(socketPath);
  const pending = new Map();
  let buffer = Buffer.alloc(0);
  let nextId = 1;
  socket.on('data', (chunk) => {
    buffer = Buffer.concat([buffer, chunk]);
    while (buffer.length >= 4) {
      const size = buffer.readUInt32BE(0);
      if (buffer.length < 4 + size) break;
      const reply = JSON.parse(buffer.subarray(4, 4 + size).toString('utf8'));
      buffer = buffer.subarray(4 + size);
      const waiter = pending.get(reply.id);
      pending.delete(reply.id);
      if (reply.error) waiter.reject(new Error(`${reply.error.type}: ${reply.error.message}`));
      else waiter.resolve(reply.rows);
    }
  });
  return {
    commands: [],
    async query(sql, values) {
      const text = sqlstring.format(sql, values || []);
      this.commands.push(text.split(' ').slice(0, 2).join(' '));
      const id = nextId++;
      const body = Buffer.from(JSON.stringify({ id, sql: text }), 'utf8');
      const header = Buffer.alloc(4);
      header.writeUInt32BE(body.length, 0);
      return new Promise((resolve, reject) => {
        pending.set(id, { resolve, reject });
        socket.write(Buffer.concat([header, body]));
      });
    },
    async hasCapability() { return true; },
    close() { socket.end(); },
  };
}

async function main() {
  const driver = connect();
  const executions = [];
  const events = [];
  const queue = new QueryQueue('cube#compat', {
    cacheAndQueueDriver: 'cubestore',
    cubeStoreDriverFactory: async () => driver,
    concurrency: 2,
    continueWaitTimeout: 5,
    logger: (message, event) => events.push({ message, fastTrack: event.fastTrack }),
    queryHandlers: {
      foo: async (query) => {
        executions.push(query.n);
        await new Promise((r) => setTimeout(r, 200));
        return { n: query.n, doubled: query.n * 2, text: "it's \"quoted\"\n" };
      },
    },
  });
  const plain = await queue.executeInQueue('foo', ['select plain', []], { n: 1 }, 0);
  const [a, b] = await Promise.all([
    queue.executeInQueue('foo', ['select shared', []], { n: 2 }, 0),
    queue.executeInQueue('foo', ['select shared', []], { n: 2 }, 0),
  ]);
  const fast = await queue.executeInQueue('foo', ['select fast', []], { n: 3 }, 10);
  await queue.shutdown();
  driver.close();
  process.stdout.write(JSON.stringify({
    plain, a, b, fast, executions,
    fastTrackEvents: events.filter((e) => e.message === 'Added to queue').map((e) => e.fastTrack),
    commands: [...new Set(driver.commands)].sort(),
  }));
}

main().catch((error) => { console.error(error); process.exit(1); });
